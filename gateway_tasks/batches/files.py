"""Batch API files: stored on disk in ``batch_dir``, indexed in Redis under the tenant's tag.

    store = FileStore(gw)
    f = store.upload("acme", "requests.jsonl", "batch", data)   # OpenAI's file object
    store.get("acme", f["id"]); store.path("acme", f["id"]); store.delete("acme", f["id"])

A file's bytes live at ``<batch_dir>/files/<file id>`` (the id is random; the tenant is not
in the path, so no tenant id can reach outside the directory).  Redis keeps its index hash
(``Keys.batch_file``), the tenant's list (``Keys.batch_files``) and the bytes the tenant
stores (``Keys.batch_file_bytes``), capped by ``batch_max_tenant_bytes``.  Another tenant's
file id is ``TaskNotFound``, as an unknown one.  The REST routes pass the tenant
generation's tag (``Tenant.owner_tag``) as ``tenant_id``: a tenant id registered again never
sees an earlier one's files.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway_tasks.core.errors import ApiError, InvalidRequest, QuotaExceeded, TaskNotFound

if TYPE_CHECKING:
    from gateway_tasks.producer.gateway import Gateway

PURPOSES = ("batch", "batch_output")
UPLOAD_PURPOSES = ("batch",)
STORAGE_FULL = "batch_storage"   # QuotaExceeded reason: the tenant's stored bytes are at its cap


def batch_dir_of(gw: "Gateway") -> Path:
    """The configured directory (created if needed); 404 while the Batch API is off (no such
    resource on this deployment: a client error to fix by configuration, not an outage)."""
    if not gw.settings.batch_dir:
        raise ApiError(404, "BatchesDisabled", "the Batch API is off on this deployment (batch_dir is not set)")
    root = Path(gw.settings.batch_dir) / "files"
    root.mkdir(parents=True, exist_ok=True)
    return root


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileStore:
    def __init__(self, gw: "Gateway"):
        self.gw, self.r, self.keys = gw, gw.r, gw.keys

    def path(self, tenant_id: str, file_id: str) -> Path:
        """Where an indexed file of the tenant's is (TaskNotFound for another's or none)."""
        self.get(tenant_id, file_id)
        return batch_dir_of(self.gw) / file_id

    def upload(self, tenant_id: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}")
        if not data:
            raise InvalidRequest("the file is empty")
        limit = self.gw.settings.batch_max_file_bytes
        if len(data) > limit:
            raise InvalidRequest(f"the file has {len(data)} bytes; at most {limit} per file")
        self._take_bytes(tenant_id, len(data))
        file_id = new_file_id()
        try:
            target = batch_dir_of(self.gw) / file_id
            tmp = target.with_suffix(".part")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        except BaseException:
            self.r.decrby(self.keys.batch_file_bytes(tenant_id), len(data))
            raise
        return self._index(tenant_id, file_id, filename, purpose, len(data))

    def register_output(self, tenant_id: str, file_id: str, filename: str) -> dict[str, Any]:
        """Index a file the runner wrote (an output or error file); its bytes count to the cap."""
        size = (batch_dir_of(self.gw) / file_id).stat().st_size
        self.r.incrby(self.keys.batch_file_bytes(tenant_id), size)
        return self._index(tenant_id, file_id, filename, "batch_output", size)

    def _take_bytes(self, tenant_id: str, size: int) -> None:
        cap = self.gw.settings.batch_max_tenant_bytes
        key = self.keys.batch_file_bytes(tenant_id)
        if int(self.r.incrby(key, size)) > cap:
            used = int(self.r.decrby(key, size))
            raise QuotaExceeded(f"storing {size} more bytes would pass this tenant's cap of {cap} bytes "
                                f"({used} stored); delete files first", None, STORAGE_FULL)

    def _index(self, tenant_id: str, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        created = int(time.time())
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.batch_file(tenant_id, file_id), mapping={
                "id": file_id, "filename": filename, "purpose": purpose, "bytes": size, "created_at": created})
            pipe.zadd(self.keys.batch_files(tenant_id), {file_id: created})
            pipe.execute()
        return file_object(file_id, filename, purpose, size, created)

    def get(self, tenant_id: str, file_id: str) -> dict[str, Any]:
        raw = self.r.hgetall(self.keys.batch_file(tenant_id, file_id)) if file_id.startswith("file-") else {}
        if not raw:
            raise TaskNotFound(f"no file {file_id!r} for this tenant")
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return file_object(f["id"], f["filename"], f["purpose"], int(f["bytes"]), int(f["created_at"]))

    def list(self, tenant_id: str, limit: int = 100) -> list[dict[str, Any]]:
        ids = [i.decode() for i in self.r.zrevrange(self.keys.batch_files(tenant_id), 0, limit - 1)]
        out = []
        for file_id in ids:
            try:
                out.append(self.get(tenant_id, file_id))
            except TaskNotFound:
                continue
        return out

    def delete(self, tenant_id: str, file_id: str) -> dict[str, Any]:
        f = self.get(tenant_id, file_id)
        with self.r.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.batch_file(tenant_id, file_id))
            pipe.zrem(self.keys.batch_files(tenant_id), file_id)
            pipe.decrby(self.keys.batch_file_bytes(tenant_id), f["bytes"])
            pipe.execute()
        (batch_dir_of(self.gw) / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}


def file_object(file_id: str, filename: str, purpose: str, size: int, created: int) -> dict[str, Any]:
    """OpenAI's file object."""
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "status_details": None, "expires_at": None}
