"""The OpenAI Batch API, served by the gateway (``gateway_tasks.batches``), in OpenAI's
format so that the official SDK works unchanged:

    POST   /v1/files                   multipart: file (JSONL), purpose=batch -> file object
    GET    /v1/files, /v1/files/{id}   the tenant's files
    GET    /v1/files/{id}/content      the bytes (an input, output or error file)
    DELETE /v1/files/{id}
    POST   /v1/batches                 {input_file_id, endpoint, completion_window, metadata?}
    GET    /v1/batches, /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Every id is the calling tenant's own: another tenant's is 404, as an unknown one.  Files and
batches belong to the tenant's generation (``Tenant.owner_tag``): a tenant deleted and
registered again under the same id sees none of its predecessor's.  With
``batch_dir`` unset the Batch API answers 404 (BatchesDisabled).
"""

from __future__ import annotations

from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway_tasks.batches.files import FileStore, batch_dir_of
from gateway_tasks.batches.jobs import cancel_batch, create_batch, get_batch, list_batches
from gateway_tasks.core.errors import InvalidRequest
from gateway_tasks.rest.auth import TenantDep

router = APIRouter(tags=["batches"])


class BatchRequest(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str = Field(description="/v1/chat/completions or /v1/embeddings")
    completion_window: str = Field(description="24h")
    metadata: dict[str, str] | None = None


def multipart_fields(content_type: str, body: bytes) -> dict[str, tuple[str, bytes]]:
    """The parts of a multipart/form-data body: name -> (filename, bytes), with the standard
    library's MIME parser (no extra dependency)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest("POST /v1/files takes multipart/form-data (file, purpose)")
    message: Message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise InvalidRequest("the multipart body could not be read")
    out: dict[str, tuple[str, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True) or b""
            out[name] = (str(part.get_filename() or ""), payload)
    return out


def _gw(request: Request) -> Any:
    gw = request.app.state.gateway
    batch_dir_of(gw)          # 404 while the Batch API is off
    return gw


@router.post("/v1/files", name="upload_file")
async def upload_file(request: Request, tenant: TenantDep) -> dict[str, Any]:
    gw = _gw(request)
    parts = multipart_fields(request.headers.get("content-type", ""), await request.body())
    if "file" not in parts:
        raise InvalidRequest("the multipart body has no 'file' part")
    purpose = parts.get("purpose", ("", b""))[1].decode("utf-8", "replace")
    filename, data = parts["file"]
    return await run_in_threadpool(FileStore(gw).upload, tenant.owner_tag, filename or "upload.jsonl",
                                   purpose, data)


@router.get("/v1/files", name="list_files")
def list_files(request: Request, tenant: TenantDep) -> dict[str, Any]:
    return {"object": "list", "data": FileStore(_gw(request)).list(tenant.owner_tag), "has_more": False}


@router.get("/v1/files/{file_id}", name="retrieve_file")
def retrieve_file(file_id: str, request: Request, tenant: TenantDep) -> dict[str, Any]:
    return FileStore(_gw(request)).get(tenant.owner_tag, file_id)


@router.get("/v1/files/{file_id}/content", name="file_content", response_class=FileResponse)
def file_content(file_id: str, request: Request, tenant: TenantDep) -> FileResponse:
    path = FileStore(_gw(request)).path(tenant.owner_tag, file_id)
    return FileResponse(path, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}", name="delete_file")
def delete_file(file_id: str, request: Request, tenant: TenantDep) -> dict[str, Any]:
    return FileStore(_gw(request)).delete(tenant.owner_tag, file_id)


@router.post("/v1/batches", name="create_batch")
def post_batch(body: BatchRequest, request: Request, tenant: TenantDep) -> dict[str, Any]:
    return create_batch(_gw(request), tenant.owner_tag, body.input_file_id, body.endpoint,
                        body.completion_window, body.metadata)


@router.get("/v1/batches", name="list_batches")
def get_batches(request: Request, tenant: TenantDep, limit: int = Query(20, ge=1, le=100),
                after: str | None = None) -> dict[str, Any]:
    return list_batches(_gw(request), tenant.owner_tag, limit, after)


@router.get("/v1/batches/{batch_id}", name="retrieve_batch")
def retrieve_batch(batch_id: str, request: Request, tenant: TenantDep) -> dict[str, Any]:
    return get_batch(_gw(request), tenant.owner_tag, batch_id)


@router.post("/v1/batches/{batch_id}/cancel", name="cancel_batch")
def post_cancel(batch_id: str, request: Request, tenant: TenantDep) -> dict[str, Any]:
    return cancel_batch(_gw(request), tenant.owner_tag, batch_id)
