"""LoRA adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), against the same reference as tests/test_lora.py (transformers on the
base checkpoint with the adapter merged in):

- the target loads only when started with --enable-runtime-lora; the same files again are no
  change, other files under a loaded name are refused, as are directories it cannot serve and more
  than --max-loras adapters; an unloaded adapter is forgotten
- through the router: a loaded adapter is listed and answers as the merged model; one unloaded and
  loaded again under its name with other files answers as the new files, never from the KV the old
  ones left in the prefix cache; an unload waits for the requests running with it
- a replica that joins without an adapter the router serves gets it loaded; a restarted target gets
  back the adapters loaded at runtime; a replica that cannot load one is kept out
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import grpc
import httpx
import pytest

from common.block_hash import ROOT, adapter_root
from common.protocol import MISSING_ADAPTER_METADATA
from router.clients import AdapterMissing, ServiceDown, _translate
from router.config import RouterConfig
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.conftest import hf_greedy
from tests.stack import complete, start_draft, start_router, start_target, wait_until
from tests.test_lora import write_adapter

PROMPT = [(11 * i) % 300 + 2 for i in range(70)]  # four full blocks of 16


@pytest.fixture(scope="module")
def dirs(model_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-lora")
    return {name: write_adapter(model_pair[0], root / name, seed) for seed, name in enumerate(("a", "b", "c"))}


# ---- the target's RPCs ---------------------------------------------------------------------------
def _stub(server) -> target_pb2_grpc.TargetServiceStub:  # noqa: ANN001
    return target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(server.address))


def _load(stub, name: str, path: object) -> common_pb2.LoraAdapterInfo:  # noqa: ANN001
    return stub.LoadLoraAdapter(target_pb2.LoadLoraAdapterRequest(name=name, path=str(path)), timeout=60)


def _refused(call, code: grpc.StatusCode, says: str) -> None:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code and says in err.value.details(), err.value.details()


def test_a_target_loads_at_runtime_only_when_allowed(model_pair, dirs):
    server, runner = start_target(model_pair[0])
    try:
        stub = _stub(server)
        _refused(lambda: _load(stub, "a", dirs["a"]), grpc.StatusCode.FAILED_PRECONDITION, "--enable-runtime-lora")
        assert not runner.adapters
    finally:
        server.stop()


def test_a_root_keeps_runtime_loads_inside_it(model_pair, dirs):
    server, runner = start_target(model_pair[0], runtime_lora=True, lora_root=dirs["a"].parent)
    try:
        stub = _stub(server)
        assert _load(stub, "a", dirs["a"]).name == "a"
        outside = dirs["a"].parent.parent / "elsewhere"
        _refused(lambda: _load(stub, "b", outside), grpc.StatusCode.INVALID_ARGUMENT, "outside --runtime-lora-root")
        _refused(lambda: _load(stub, "c", dirs["a"] / ".." / ".." / "x"), grpc.StatusCode.INVALID_ARGUMENT,
                 "outside --runtime-lora-root")
        assert list(runner.adapters) == ["a"]
    finally:
        server.stop()


def test_target_load_unload_and_their_refusals(model_pair, dirs, tmp_path):
    server, runner = start_target(model_pair[0], runtime_lora=True, max_loras=2)
    try:
        stub = _stub(server)
        info = _load(stub, "a", dirs["a"])
        assert info.name == "a" and info.path == str(dirs["a"]) and info.block_root not in (ROOT, adapter_root("a"))
        assert _load(stub, "a", dirs["a"]) == info, "the same files again: no change"
        assert _load(stub, "b-2", dirs["b"]).block_root != info.block_root
        listed = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert list(listed.lora_adapters) == ["a", "b-2"] and [a.name for a in listed.lora] == ["a", "b-2"]
        _refused(lambda: _load(stub, "a", dirs["b"]), grpc.StatusCode.ALREADY_EXISTS, "other files")
        _refused(lambda: _load(stub, "c", dirs["c"]), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-loras")
        _refused(lambda: _load(stub, "d", tmp_path), grpc.StatusCode.INVALID_ARGUMENT, "no PEFT LoRA adapter")
        _refused(lambda: _load(stub, "no spaces", dirs["c"]), grpc.StatusCode.INVALID_ARGUMENT, "name")
        stub.UnloadLoraAdapter(target_pb2.UnloadLoraAdapterRequest(name="a"), timeout=10)
        assert list(runner.adapters) == ["b-2"]
        _refused(lambda: stub.UnloadLoraAdapter(target_pb2.UnloadLoraAdapterRequest(name="a"), timeout=10),
                 grpc.StatusCode.NOT_FOUND, "'a'")
        assert _load(stub, "c", dirs["c"]).name == "c", "room again after the unload"
    finally:
        server.stop()


def test_a_step_naming_an_adapter_the_target_lacks_says_which(model_pair):
    """Not a bad request: the target lost it (a restart), so the router's client hears AdapterMissing,
    a ServiceDown whose recovery loads it again."""
    server, runner = start_target(model_pair[0])
    try:
        entry = target_pb2.StepEntry(seq_id=1, start_pos=0, tokens=[5, 6], emit=True, lora="gone",
                                     sampling=common_pb2.SamplingParams(temperature=0.0))
        with pytest.raises(grpc.RpcError) as err:
            _stub(server).Step(target_pb2.StepRequest(entries=[entry]), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (MISSING_ADAPTER_METADATA, "gone") in tuple(err.value.trailing_metadata())
        translated = _translate(err.value)
        assert isinstance(translated, AdapterMissing) and isinstance(translated, ServiceDown)
        assert runner.cached_len(1) == 0
    finally:
        server.stop()


# ---- through the router --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(model_pair):
    target, _ = start_target(model_pair[0], runtime_lora=True, step_delay_s=0.01)
    draft, _ = start_draft(model_pair[1])
    router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=16), target.address, draft.address,
                          model_pair[0])
    yield router
    router.stop(), target.stop(), draft.stop()


def _post(router, path: str, **body) -> httpx.Response:  # noqa: ANN001, ANN003
    return httpx.post(f"{router.url}{path}", json=body, timeout=120)


def test_a_loaded_adapter_is_listed_and_answers_as_the_merged_model(stack, model_pair, dirs):
    r = _post(stack, "/v1/load_lora_adapter", lora_name="hot", lora_path=str(dirs["a"]))
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'hot' added successfully."
    assert [m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]] == ["tiny", "hot"]
    out = complete(stack.url, PROMPT[:9], 12, model="hot")
    assert out["choices"][0]["token_ids"] == hf_greedy(dirs["a"] / "merged", PROMPT[:9], 12)
    assert out["choices"][0]["token_ids"] != complete(stack.url, PROMPT[:9], 12)["choices"][0]["token_ids"]
    for body, param, says in [({"lora_name": "hot", "lora_path": str(dirs["b"])}, "lora_name", "already been loaded"),
                              ({"lora_name": "tiny", "lora_path": str(dirs["b"])}, "lora_name", "name an adapter"),
                              ({"lora_name": "x", "lora_path": "/nowhere"}, "lora_path", "no PEFT LoRA adapter"),
                              ({"lora_name": "x"}, "lora_path", "lora_path")]:
        r = _post(stack, "/v1/load_lora_adapter", **body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == param, r.text
    assert _post(stack, "/v1/unload_lora_adapter", lora_name="hot").status_code == 200
    assert _post(stack, "/v1/unload_lora_adapter", lora_name="hot").status_code == 404


def test_an_adapter_loaded_again_with_other_files_never_reads_the_old_ones_kv(stack, dirs):
    assert _post(stack, "/v1/load_lora_adapter", lora_name="swap", lora_path=str(dirs["a"])).status_code == 200
    complete(stack.url, PROMPT, 4, model="swap")
    assert complete(stack.url, PROMPT, 4, model="swap")["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert _post(stack, "/v1/unload_lora_adapter", lora_name="swap").status_code == 200
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": "swap", "prompt": [5], "max_tokens": 2})
    assert r.status_code == 404
    assert _post(stack, "/v1/load_lora_adapter", lora_name="swap", lora_path=str(dirs["b"])).status_code == 200
    out = complete(stack.url, PROMPT, 4, model="swap")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the old files' KV is not the new ones'"
    assert out["choices"][0]["token_ids"] == hf_greedy(dirs["b"] / "merged", PROMPT, 4)
    assert _post(stack, "/v1/unload_lora_adapter", lora_name="swap").status_code == 200


def test_an_unload_waits_for_the_requests_running_with_the_adapter(stack, dirs):
    assert _post(stack, "/v1/load_lora_adapter", lora_name="busy", lora_path=str(dirs["c"])).status_code == 200
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(complete, stack.url, PROMPT[:20], 150, model="busy")
        assert wait_until(lambda: 'adapter="busy"' in httpx.get(f"{stack.url}/metrics").text, 30)
        time.sleep(0.2)
        unload = pool.submit(_post, stack, "/v1/unload_lora_adapter", lora_name="busy")
        time.sleep(0.3)
        refused = httpx.post(f"{stack.url}/v1/completions", json={"model": "busy", "prompt": [5], "max_tokens": 2})
        assert refused.status_code == 404, "an adapter being unloaded takes no new request"
        out = running.result(timeout=120)
        assert unload.result(timeout=120).status_code == 200
    assert out["choices"][0]["token_ids"] == hf_greedy(dirs["c"] / "merged", PROMPT[:20], 150)
    assert "busy" not in [m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]]


def test_two_loads_of_one_name_at_once_load_one_of_them(stack, model_pair, dirs):
    with cf.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda d: _post(stack, "/v1/load_lora_adapter", lora_name="twice", lora_path=str(d)),
                                (dirs["a"], dirs["b"])))
    assert sorted(r.status_code for r in answers) == [200, 400], [r.text for r in answers]
    won = dirs["a"] if answers[0].status_code == 200 else dirs["b"]
    out = complete(stack.url, PROMPT[:9], 8, model="twice")
    assert out["choices"][0]["token_ids"] == hf_greedy(won / "merged", PROMPT[:9], 8), "the winner's files, served"
    assert _post(stack, "/v1/unload_lora_adapter", lora_name="twice").status_code == 200


def test_the_router_says_when_targets_do_not_load_at_runtime(model_pair, dirs):
    target, _ = start_target(model_pair[0])
    router = start_router(RouterConfig(max_num_batched_tokens=64), target.address, None, model_pair[0])
    try:
        r = _post(router, "/v1/load_lora_adapter", lora_name="a", lora_path=str(dirs["a"]))
        assert r.status_code == 400 and "--enable-runtime-lora" in r.json()["error"]["message"]
        assert [m["id"] for m in httpx.get(f"{router.url}/v1/models").json()["data"]] == ["tiny"]
    finally:
        router.stop(), target.stop()


# ---- replicas ------------------------------------------------------------------------------------
def test_replicas_get_the_adapters_they_lack_and_a_restart_gets_them_back(model_pair, dirs):
    """Target 1 starts with --lora-modules a; target 2 with nothing but runtime loading: the router
    loads a there too. Then b is loaded at runtime, target 2 restarts empty, and gets a and b back."""
    t1, r1 = start_target(model_pair[0], adapters={"a": dirs["a"]}, runtime_lora=True)
    t2, r2 = start_target(model_pair[0], runtime_lora=True)
    router = start_router(RouterConfig(max_num_batched_tokens=64, target_grace_s=30), f"{t1.address},{t2.address}",
                          None, model_pair[0])
    try:
        assert wait_until(lambda: len(httpx.get(f"{router.url}/ready").json()["replicas"]) == 2, 30)
        assert sorted(r2.adapters) == ["a"] and r2.adapters["a"].root == r1.adapters["a"].root
        assert _post(router, "/v1/load_lora_adapter", lora_name="b", lora_path=str(dirs["b"])).status_code == 200
        assert sorted(r1.adapters) == sorted(r2.adapters) == ["a", "b"]
        port = t2.port
        t2.stop(timeout=15)
        t2, r2 = start_target(model_pair[0], port=port, runtime_lora=True)
        # at once: a step naming an adapter the restarted replica lacks recovers it (else its probe does)
        with cf.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda m: complete(router.url, PROMPT[:9], 8, model=m), ["a", "b"] * 4))
        for model, out in zip(["a", "b"] * 4, outs, strict=True):
            assert out["choices"][0]["token_ids"] == hf_greedy(dirs[model] / "merged", PROMPT[:9], 8)
        assert sorted(r2.adapters) == ["a", "b"], "the restarted replica got its adapters back"
    finally:
        router.stop(), t1.stop(), t2.stop()


def test_a_replica_that_cannot_load_an_adapter_is_kept_out(model_pair, dirs):
    t1, _ = start_target(model_pair[0], adapters={"a": dirs["a"]})
    t2, r2 = start_target(model_pair[0])  # no adapter, no runtime loading
    try:
        with pytest.raises(Exception, match="lacks LoRA adapter 'a' and could not load it .*--enable-runtime-lora"):
            start_router(RouterConfig(max_num_batched_tokens=64), f"{t1.address},{t2.address}", None, model_pair[0])
        assert not r2.adapters
    finally:
        t1.stop(), t2.stop()
