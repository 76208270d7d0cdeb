"""REST fuzzing over the API's own OpenAPI schema (schemathesis: valid and
invalid data for every operation), against a real Redis, a real worker and the
upstream simulator.

Per case: no 5xx; every answer documented in the schema and matching its body
schema (schemathesis' checks); invalid data rejected with a 4xx; and a request
answered 4xx enqueued nothing (the pool's enqueue sequence, which every enqueue
increments, did not move).  Bodies are bounded: the deployment's
max_request_bytes is 64 KiB here, and a body over it is a 413 without parsing.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import hypothesis
import pytest

schemathesis = pytest.importorskip("schemathesis")

from fastapi.testclient import TestClient  # noqa: E402

from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402
from schemathesis.core.parameters import ParameterLocation  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402

from gateway_tasks.core.keys import Keys  # noqa: E402
from gateway_tasks.core.settings import Pool, load_settings  # noqa: E402
from devtools import processes  # noqa: E402
from gateway_tasks.simulator import SimConfig, SimulatorThread  # noqa: E402
from gateway_tasks.producer.gateway import Gateway  # noqa: E402
from gateway_tasks.rest.app import create_app  # noqa: E402
from gateway_tasks.rest.auth import ADMIN, PUBLIC, access_of  # noqa: E402
from gateway_tasks.rest.openapi import SYNC_PATHS  # noqa: E402

pytestmark = pytest.mark.slow

ADMIN_KEY = "fuzz-admin-" + "k" * 24
MAX_BODY = 64 * 1024
EXAMPLES = 60


@pytest.fixture(scope="module")
def deployment(redis_url, module_key_prefix, tmp_path_factory):
    prefix = module_key_prefix
    config = SimConfig(tpm=2_000_000, rpm=100_000, base_latency_ms=1, ms_per_output_token=0,
                       completion_fraction=0.001)
    with SimulatorThread(config) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="sk-fuzz-upstream",
                    models=("gpt-4o-mini", "gpt-4o"), tpm=2_000_000, rpm=100_000)
        settings = load_settings(env={}, redis_url=redis_url, key_prefix=prefix, pools=(pool,),
                                 admin_key=ADMIN_KEY, max_request_bytes=MAX_BODY)
        gw = Gateway(settings)
        tenant_key = gw.register_tenant("fuzzer", "vip")
        log = tmp_path_factory.mktemp("fuzz") / "worker.log"
        worker = processes.worker(settings, concurrency=4, log_path=str(log)).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            yield SimpleNamespace(gw=gw, app=create_app(gw), tenant_key=tenant_key, worker=worker,
                                  log=log, keys=Keys(prefix))
        finally:
            worker.stop()
            gw.app.close()
            gw.r.close()


@pytest.fixture(scope="module")
def api_schema(deployment):
    # invalid data must be rejected with a 4xx; 413 counts too: a max_tokens over the schema's
    # maximum is a prompt that could never be admitted (PromptTooLarge), as the schema says
    config = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {
        "expected-statuses": ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428",
                              "429", "5xx"]}}})
    return schemathesis.openapi.from_asgi("/openapi.json", deployment.app, config=config)


def _enqueued(gw: Gateway) -> int:
    """How many enqueues the pool has seen (lua/dispatch/enqueue.lua INCRs this per task)."""
    return int(gw.r.get(Keys(gw.settings.key_prefix).seq("default")) or 0)


def _drops_its_credential(case) -> bool:
    """A negative case whose headers leave the Authorization header out on purpose."""
    meta = case._meta   # schemathesis's record of which components it made invalid
    info = meta.components.get(ParameterLocation.HEADER) if meta is not None else None
    return (info is not None and info.mode == schemathesis.GenerationMode.NEGATIVE
            and "authorization" not in {name.lower() for name in (case.headers or {})})


def _credential(deployment, case) -> dict[str, str]:
    access = access_of(case.path)
    if access == PUBLIC or _drops_its_credential(case):   # the latter: a 401 is its answer
        return {}
    return {"Authorization": f"Bearer {ADMIN_KEY if access == ADMIN else deployment.tenant_key}"}


def _prepare(case) -> None:
    # each change assigns case.body anew, so that schemathesis judges the body as it is sent
    # (an invalid deadline_s removed leaves a valid body, which must then be accepted)
    if case.path == "/v1/chat/completions" and isinstance(case.body, dict) and "deadline_s" in case.body:
        # the caller's own wait limit (deadline_s) may be shorter than any answer: 504 by design
        case.body = {k: v for k, v in case.body.items() if k != "deadline_s"}
    key = case.body.get("idempotency_key") if isinstance(case.body, dict) else None
    if case.path == "/v1/chat/completions" and isinstance(key, str) and 1 <= len(key) <= 238:
        # a key another case used names that case's task: one with a deadline too short for
        # any answer (504 by design), or one a repeat returns without enqueuing it again --
        # each sync case's key is its own
        case.body = {**case.body, "idempotency_key": f"sync-{uuid.uuid4().hex[:12]}:{key}"}
    # keep the fuzzing tenant itself: admin writes and deletes go to other ids
    if isinstance(case.body, dict) and case.body.get("tenant_id") == "fuzzer":
        case.body = {**case.body, "tenant_id": "fuzzer-2"}
    if isinstance(case.path_parameters, dict) and case.path_parameters.get("tenant_id") == "fuzzer":
        case.path_parameters["tenant_id"] = "fuzzer-2"


def _check_case(deployment, case, seen: dict) -> None:
    _prepare(case)
    headers = {**(case.headers or {}), **_credential(deployment, case)}
    before = _enqueued(deployment.gw)
    # positive_data_acceptance is left out: a schema-valid request may still be refused for
    # what a schema cannot say (an unknown tier or model, a blank prompt, a prompt over the
    # bucket) -- with a 400/413 that the other checks validate against the schema
    response = case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])
    after = _enqueued(deployment.gw)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        # a task that ran and failed (the upstream refused it: its 4xx passed through) names
        # itself; any other rejection enqueued nothing
        ran = 1 if "x-gateway-task-id" in {name.lower() for name in response.headers} else 0
        assert after - before == ran, ("a rejected request enqueued something", case.path, case.body,
                                       response.text)
    seen[(case.method.upper(), case.path, response.status_code)] = \
        seen.get((case.method.upper(), case.path, response.status_code), 0) + 1


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_fuzz_every_operation(api_schema, deployment, mode):
    """Every operation of the schema, EXAMPLES cases each, in this mode (valid or invalid data)."""
    seen: dict = {}
    unfuzzable: list[str] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 9
    for operation in operations:
        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            _check_case(deployment, case, seen)

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            # no parameter and no body: there is no invalid request to make of it
            assert mode == schemathesis.GenerationMode.NEGATIVE, operation.label
            assert not (operation.body or operation.path_parameters or operation.query), operation.label
            unfuzzable.append(operation.label)
    assert deployment.worker.alive()
    statuses = {status for (_, _, status) in seen}
    print(f"fuzz {mode.value}: {sum(seen.values())} requests over {len(operations)} operations, "
          f"statuses {sorted(statuses)}; no invalid form: {unfuzzable}")
    if mode == schemathesis.GenerationMode.POSITIVE:
        assert ("POST", "/v1/tasks", 202) in seen and ("POST", "/v1/chat/completions", 200) in seen
    else:
        assert 400 in statuses


def test_bodies_over_the_limit_are_refused_before_parsing(deployment):
    client = TestClient(deployment.app)
    headers = {"Authorization": f"Bearer {deployment.tenant_key}", "Content-Type": "application/json"}
    before = _enqueued(deployment.gw)
    for path in ("/v1/tasks", "/v1/chat/completions"):
        body = b'{"messages": "' + b"x" * MAX_BODY + b'"}'
        resp = client.post(path, content=body, headers=headers)
        assert resp.status_code == 413 and resp.json()["error"]["type"] == "RequestTooLarge"
    assert _enqueued(deployment.gw) == before


def test_schema_lists_400_not_422(deployment):
    schema = deployment.app.openapi()
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            if path in SYNC_PATHS and "422" in op["responses"]:   # an upstream's own, passed through
                assert "the upstream refused the request" in op["responses"]["422"]["description"]
            else:
                assert "422" not in op["responses"], (method, path)
            if access_of(path) != PUBLIC:
                assert {"400", "401"} <= set(op["responses"]), (method, path)
                assert op["responses"]["400"]["content"]["application/json"]["schema"] == \
                    {"$ref": "#/components/schemas/Error"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
