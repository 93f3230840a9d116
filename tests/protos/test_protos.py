"""Tests for the dspark.v1 contracts (protos/), their generated stubs (dspark_protos/) and the
regeneration script (scripts/gen_protos.py)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2

from dspark_protos.dspark.v1 import (
    drafter_service_pb2_grpc,
    scheduler_service_pb2_grpc,
    types_pb2,
    verifier_service_pb2_grpc,
)
from dspark_protos.tensors import tensor_from_proto, tensor_to_proto

REPO = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO / "scripts" / "gen_protos.py"
PROTO_FILES = ["dspark/v1/drafter_service.proto", "dspark/v1/scheduler_service.proto",
               "dspark/v1/types.proto", "dspark/v1/verifier_service.proto"]
STUB_MODULES = [f"dspark_protos.dspark.v1.{m}" for m in (
    "types_pb2", "scheduler_service_pb2", "scheduler_service_pb2_grpc", "verifier_service_pb2",
    "verifier_service_pb2_grpc", "drafter_service_pb2", "drafter_service_pb2_grpc")]

# service -> rpc -> (request, response, server_streaming)
EXPECTED_RPCS = {
    "SchedulerService": {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "GenerateUnary": ("GenerateUnaryRequest", "GenerateUnaryResponse", False),
        "ListModels": ("ListModelsRequest", "ListModelsResponse", False),
    },
    "VerifierService": {
        "Prefill": ("PrefillRequest", "PrefillResponse", False),
        "Verify": ("VerifyRequest", "VerifyResponse", False),
        "Resume": ("ResumeRequest", "ResumeResponse", False),
        "Release": ("VerifierServiceReleaseRequest", "VerifierServiceReleaseResponse", False),
        "GetInfo": ("VerifierServiceGetInfoRequest", "VerifierServiceGetInfoResponse", False),
    },
    "DrafterService": {
        "Propose": ("ProposeRequest", "ProposeResponse", False),
        "Release": ("DrafterServiceReleaseRequest", "DrafterServiceReleaseResponse", False),
        "GetInfo": ("DrafterServiceGetInfoRequest", "DrafterServiceGetInfoResponse", False),
    },
}
GRPC_MODULES = {
    "SchedulerService": scheduler_service_pb2_grpc,
    "VerifierService": verifier_service_pb2_grpc,
    "DrafterService": drafter_service_pb2_grpc,
}


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", GEN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_protos", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gen_protos = _load_gen_protos()


@pytest.fixture(scope="module")
def fds(tmp_path_factory) -> descriptor_pb2.FileDescriptorSet:
    """protos/ compiled by protoc with source info (comments, locations)."""
    return gen_protos.descriptor_set(tmp_path_factory.mktemp("fds") / "set.pb", REPO, source_info=True)


@pytest.fixture(scope="module")
def files(fds) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    return {f.name: f for f in fds.file}


def _run_gen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GEN_SCRIPT), *args], capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------------------------
# Regeneration
# --------------------------------------------------------------------------------------------


def test_regeneration_is_byte_identical():
    recorded, installed = gen_protos.recorded_generator_version(REPO), gen_protos.generator_version()
    if recorded != installed:
        pytest.skip(f"stubs were generated with grpcio-tools {recorded}, {installed} is installed: a byte-for-byte "
                    "check needs the same generator (test_committed_stubs_match_protos still checks content)")
    proc = _run_gen("--check")
    assert proc.returncode == 0, f"scripts/gen_protos.py --check failed:\n{proc.stdout}{proc.stderr}"


def _clear_json_names(messages) -> None:
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _clear_json_names(m.nested_type)


def test_committed_stubs_match_protos(files):
    """Generator-version independent: the descriptors embedded in the committed stubs equal protos/."""
    assert sorted(files) == PROTO_FILES
    for name, fresh in files.items():
        module = importlib.import_module("dspark_protos." + name.removesuffix(".proto").replace("/", ".") + "_pb2")
        embedded = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        fresh = descriptor_pb2.FileDescriptorProto()
        fresh.CopyFrom(files[name])
        fresh.ClearField("source_code_info")
        _clear_json_names(fresh.message_type)  # --descriptor_set_out adds them; the stubs omit them
        assert embedded == fresh, f"{module.__name__} is out of date with protos/{name}: run scripts/gen_protos.py"


def test_check_reports_drift_and_regeneration_fixes_it(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "protos", root / "protos")
    shutil.copytree(REPO / "dspark_protos", root / "dspark_protos", ignore=shutil.ignore_patterns("__pycache__"))
    v1 = root / "dspark_protos" / "dspark" / "v1"
    (v1 / "types_pb2.pyi").write_text((v1 / "types_pb2.pyi").read_text() + "# hand edit\n")
    (v1 / "old_service_pb2.py").write_text("# left over from a removed proto\n")
    (v1 / "drafter_service_pb2_grpc.py").unlink()
    proto = root / "protos" / "dspark" / "v1" / "types.proto"
    proto.write_text(proto.read_text().replace(
        "  uint32 num_tokens = 2;\n",
        "  uint32 num_tokens = 2;\n  // extra is a new field.\n  uint32 extra = 5;\n", 1))

    proc = _run_gen("--check", "--root", str(root))
    assert proc.returncode == 1
    for line in ("changed: dspark_protos/dspark/v1/types_pb2.py", "changed: dspark_protos/dspark/v1/types_pb2.pyi",
                 "missing: dspark_protos/dspark/v1/drafter_service_pb2_grpc.py",
                 "stale:   dspark_protos/dspark/v1/old_service_pb2.py"):
        assert line in proc.stderr, proc.stderr
    assert "verifier_service" not in proc.stderr  # untouched files are not reported

    proc = _run_gen("--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert not (v1 / "old_service_pb2.py").exists()
    assert _run_gen("--check", "--root", str(root)).returncode == 0
    assert "extra" in (v1 / "types_pb2.pyi").read_text()
    # Hand-written modules outside the generated tree are never touched.
    assert (root / "dspark_protos" / "tensors.py").read_bytes() == (REPO / "dspark_protos" / "tensors.py").read_bytes()


def test_generation_is_deterministic():
    assert gen_protos.generate(REPO) == gen_protos.generate(REPO)


# --------------------------------------------------------------------------------------------
# Style: comments, enums, naming (the Buf STANDARD + COMMENTS rules we rely on)
# --------------------------------------------------------------------------------------------


def _elements(fd: descriptor_pb2.FileDescriptorProto):
    """Yield (kind, name, source path) for every commentable element of a file."""

    def message(msg, path):
        yield "message", msg.name, path
        synthetic = {f.oneof_index for f in msg.field if f.proto3_optional}
        for i, f in enumerate(msg.field):
            yield "field", f.name, path + (2, i)
        for i, o in enumerate(msg.oneof_decl):
            if i not in synthetic:  # `optional` fields' implicit oneofs have no source
                yield "oneof", o.name, path + (8, i)
        for i, nested in enumerate(msg.nested_type):
            yield from message(nested, path + (3, i))
        for i, e in enumerate(msg.enum_type):
            yield from enum(e, path + (4, i))

    def enum(e, path):
        yield "enum", e.name, path
        for i, v in enumerate(e.value):
            yield "enum value", v.name, path + (2, i)

    for i, m in enumerate(fd.message_type):
        yield from message(m, (4, i))
    for i, e in enumerate(fd.enum_type):
        yield from enum(e, (5, i))
    for i, s in enumerate(fd.service):
        yield "service", s.name, (6, i)
        for j, m in enumerate(s.method):
            yield "rpc", m.name, (6, i, 2, j)


def test_every_element_has_a_comment_beginning_with_its_name(files):
    problems, count = [], 0
    for name, fd in files.items():
        comments = {tuple(loc.path): loc.leading_comments for loc in fd.source_code_info.location}
        for kind, elem, path in _elements(fd):
            count += 1
            text = comments.get(path, "").strip()
            if not re.match(rf"{re.escape(elem)}(?![A-Za-z0-9_])", text):
                problems.append(f"{name}: {kind} {elem}: leading comment {text[:40]!r} does not begin with its name")
    assert count > 200  # not vacuous: every message, field, enum value, service and rpc was seen
    assert not problems, "\n".join(problems)


def _buf_upper_snake(s: str) -> str:
    """Buf's stringutil.ToUpperSnakeCase (the ENUM_VALUE_PREFIX rule's expected prefix)."""
    delim = set(".-_ \t\n\r")
    s = s.strip("".join(delim))
    out = ""
    for i, c in enumerate(s):
        c = "_" if c in delim else c
        if i == 0:
            out += c
        elif c.isupper() and out[-1] != "_" and (
            (i < len(s) - 1 and not (s[i + 1].isupper() or s[i + 1].isdigit()) and s[i + 1] not in delim)
            or s[i - 1].islower()
        ):
            out += "_" + c
        elif not (c == "_" and out[-1] == "_"):
            out += c
    return out.upper()


def test_buf_upper_snake_port():
    assert _buf_upper_snake("DType") == "D_TYPE"  # why the enum is spelled Dtype
    assert _buf_upper_snake("Dtype") == "DTYPE"
    assert _buf_upper_snake("FinishReason") == "FINISH_REASON"


def test_enums_start_with_unspecified_zero_and_prefix_their_values(files):
    enums = [e for fd in files.values() for e in fd.enum_type]
    enums += [e for fd in files.values() for m in fd.message_type for e in m.enum_type]
    assert {e.name for e in enums} >= {"Dtype", "FinishReason", "ItemStatus", "DrafterKind"}
    for e in enums:
        prefix = _buf_upper_snake(e.name)
        assert e.value[0].number == 0 and e.value[0].name == f"{prefix}_UNSPECIFIED", e.name
        assert [v.number for v in e.value].count(0) == 1, e.name
        for v in e.value:
            assert v.name.startswith(prefix + "_") and re.fullmatch(r"[A-Z][A-Z0-9_]*", v.name), v.name


def test_dtype_enum_values():
    assert {n: types_pb2.Dtype.Value(n) for n in types_pb2.Dtype.keys()} == {
        "DTYPE_UNSPECIFIED": 0, "DTYPE_FLOAT32": 1, "DTYPE_BFLOAT16": 2, "DTYPE_FLOAT16": 3,
        "DTYPE_INT64": 4, "DTYPE_INT32": 5}


def test_layout_and_naming(files):
    for name, fd in files.items():
        assert fd.package == "dspark.v1" and fd.syntax == "proto3", name
        assert Path(name).parent.as_posix() == fd.package.replace(".", "/"), name  # PACKAGE_DIRECTORY_MATCH
        assert re.fullmatch(r"[a-z][a-z0-9_]*\.proto", Path(name).name), name
        if name.endswith("_service.proto"):
            stem = Path(name).stem.removesuffix("_service")
            assert [s.name for s in fd.service] == ["".join(w.title() for w in stem.split("_")) + "Service"]
            assert not fd.message_type and not fd.enum_type, f"{name}: messages belong in types.proto"
        else:
            assert name == "dspark/v1/types.proto" and not fd.service
        for m in fd.message_type:
            assert re.fullmatch(r"[A-Z][A-Za-z0-9]*", m.name), m.name
            for f in m.field:
                assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", f.name), f"{m.name}.{f.name}"
                if f.type == f.TYPE_FLOAT or f.type == f.TYPE_DOUBLE:  # bulk tensors are bytes, not floats
                    # (per-slot values, a block's worth, are not bulk)
                    assert f.label != f.LABEL_REPEATED or m.name in {"SparseDistribution", "Proposal",
                                                                     "ConfidenceHistory"}, \
                        f"{m.name}.{f.name}: repeated floats; use Tensor"


def test_rpc_request_response_standard_and_unique(files):
    used: dict[str, str] = {}
    for fd in files.values():
        for s in fd.service:
            assert s.name.endswith("Service")
            for m in s.method:
                req, resp = m.input_type.removeprefix(".dspark.v1."), m.output_type.removeprefix(".dspark.v1.")
                assert req in (f"{m.name}Request", f"{s.name}{m.name}Request"), f"{s.name}.{m.name}: {req}"
                assert resp in (f"{m.name}Response", f"{s.name}{m.name}Response"), f"{s.name}.{m.name}: {resp}"
                for t in (req, resp):
                    assert t not in used, f"{t} used by both {used[t]} and {s.name}.{m.name}"
                    used[t] = f"{s.name}.{m.name}"


# --------------------------------------------------------------------------------------------
# Services and stubs
# --------------------------------------------------------------------------------------------


def test_services_have_expected_rpcs_and_streaming_kinds(files):
    services = {s.name: s for fd in files.values() for s in fd.service}
    assert set(services) == set(EXPECTED_RPCS)
    for sname, rpcs in EXPECTED_RPCS.items():
        methods = {m.name: m for m in services[sname].method}
        assert set(methods) == set(rpcs), sname
        for rpc, (req, resp, server_streaming) in rpcs.items():
            m = methods[rpc]
            assert m.input_type == f".dspark.v1.{req}" and m.output_type == f".dspark.v1.{resp}"
            assert m.server_streaming is server_streaming and not m.client_streaming, f"{sname}.{rpc}"

        module = GRPC_MODULES[sname]
        servicer = getattr(module, f"{sname}Servicer")
        assert callable(getattr(module, f"add_{sname}Servicer_to_server"))
        assert {n for n in vars(servicer) if not n.startswith("_")} == set(rpcs)
        stub = getattr(module, f"{sname}Stub")(grpc.insecure_channel("localhost:1"))
        for rpc, (_, _, server_streaming) in rpcs.items():
            kind = grpc.UnaryStreamMultiCallable if server_streaming else grpc.UnaryUnaryMultiCallable
            assert isinstance(getattr(stub, rpc), kind), f"{sname}.{rpc}"


def test_stubs_import_without_path_hacks(tmp_path):
    """The stubs import as a package from the repo root alone: no top-level `dspark` module needed."""
    for path in (REPO / "dspark_protos").rglob("*.py*"):
        if path.suffix in (".py", ".pyi"):
            text = path.read_text()
            assert not re.search(r"^\s*(from|import) dspark[. ]", text, re.M), f"{path}: un-rewritten import"
    code = ("import importlib, sys\n"
            f"for m in {STUB_MODULES!r}: importlib.import_module(m)\n"
            "assert 'dspark' not in sys.modules, 'a top-level dspark package was imported'\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_stub_package_ships_type_stubs():
    v1 = REPO / "dspark_protos" / "dspark" / "v1"
    for name in ("types", "scheduler_service", "verifier_service", "drafter_service"):
        assert (v1 / f"{name}_pb2.pyi").is_file()
    assert (REPO / "dspark_protos" / "py.typed").is_file()


def _fields(name: str) -> list[tuple]:
    d = getattr(types_pb2, name).DESCRIPTOR
    return [(f.name, f.number, f.type, f.is_repeated, f.message_type and f.message_type.full_name,
             f.containing_oneof and f.containing_oneof.name) for f in d.fields]


def test_mirrored_messages_stay_in_step():
    assert _fields("GenerateRequest") == _fields("GenerateUnaryRequest")
    assert _fields("PrefillResponse") == _fields("ResumeResponse")
    # Prefill's generated_prompt_tokens (4: an adopted request's count) is what Resume carries as its own
    # generated_token_ids (4); the first three fields are the same
    assert _fields("ResumeRequest")[:3] == _fields("PrefillRequest")[:3]
    req = types_pb2.GenerateRequest(prompt_text="hi", model="m", drafter="d", policy="causal", request_id="r1",
                                    sampling=types_pb2.SamplingParams(temperature=0.7, seed=0, max_new_tokens=8))
    unary = types_pb2.GenerateUnaryRequest.FromString(req.SerializeToString())
    assert unary.WhichOneof("prompt") == "prompt_text" and unary.sampling.HasField("seed")
    assert types_pb2.GenerateRequest.FromString(unary.SerializeToString()) == req


def test_optional_presence():
    assert not types_pb2.SamplingParams().HasField("seed")
    assert types_pb2.SamplingParams(seed=0).HasField("seed")  # seed 0 is a real seed
    assert not types_pb2.ProposeItem().HasField("seed")
    req = types_pb2.GenerateRequest(prompt_token_ids=types_pb2.TokenIds(token_ids=[1, 2, 3]))
    assert req.WhichOneof("prompt") == "prompt_token_ids"


def test_draft_support_payload_stays_small():
    """16 drafts with a k=64 support over a 150k vocabulary: kilobytes, not a vocabulary-sized vector."""
    gen = torch.Generator().manual_seed(0)
    item = types_pb2.VerifyItem(request_id="r", anchor_token_id=5, anchor_position=1000)
    for _ in range(16):
        ids = torch.randperm(150_000, generator=gen)[:64]
        probs = torch.softmax(torch.randn(64, generator=gen), 0)
        item.draft_token_ids.append(int(ids[0]))
        item.draft_supports.add(token_ids=ids.tolist(), probs=probs.tolist())
    assert len(item.SerializeToString()) < 8 * 1024


def test_grpc_round_trip_in_process():
    """A real server and client over the generated stubs: streaming Generate and batched Verify."""

    class Scheduler(scheduler_service_pb2_grpc.SchedulerServiceServicer):
        def Generate(self, request, context):
            yield types_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7], text_delta="a")
            yield types_pb2.GenerateResponse(request_id=request.request_id, token_ids=[8, 9], text_delta="bc",
                                             round=types_pb2.RoundStats(round_index=1, num_accepted=1))
            yield types_pb2.GenerateResponse(request_id=request.request_id,
                                             finish_reason=types_pb2.FINISH_REASON_LENGTH,
                                             summary=types_pb2.GenerationSummary(num_rounds=1, completion_tokens=3))

    class Verifier(verifier_service_pb2_grpc.VerifierServiceServicer):
        def Verify(self, request, context):
            results = []
            for item in request.items:
                feats = types_pb2.ContextFeatures(start_position=item.anchor_position)
                tensor_to_proto(torch.ones(len(item.draft_token_ids) + 1, 2, 4, dtype=torch.bfloat16),
                                feats.hidden_states)
                results.append(types_pb2.VerifyResult(
                    request_id=item.request_id, status=types_pb2.ITEM_STATUS_OK,
                    num_accepted=len(item.draft_token_ids),
                    committed_token_ids=[*item.draft_token_ids, 0], context_features=feats))
            return types_pb2.VerifyResponse(results=results)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server(Scheduler(), server)
    verifier_service_pb2_grpc.add_VerifierServiceServicer_to_server(Verifier(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            chunks = list(scheduler_service_pb2_grpc.SchedulerServiceStub(channel).Generate(
                types_pb2.GenerateRequest(prompt_text="x", request_id="r1"), timeout=30))
            assert [list(c.token_ids) for c in chunks] == [[7], [8, 9], []]
            assert "".join(c.text_delta for c in chunks) == "abc"
            assert chunks[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH and chunks[-1].summary.num_rounds == 1
            assert not chunks[0].HasField("round") and chunks[1].round.round_index == 1

            resp = verifier_service_pb2_grpc.VerifierServiceStub(channel).Verify(types_pb2.VerifyRequest(items=[
                types_pb2.VerifyItem(request_id="a", anchor_position=3, draft_token_ids=[1, 2]),
                types_pb2.VerifyItem(request_id="b", anchor_position=9),
            ]), timeout=30)
            assert [r.request_id for r in resp.results] == ["a", "b"]
            assert list(resp.results[0].committed_token_ids) == [1, 2, 0]
            feats = tensor_from_proto(resp.results[0].context_features.hidden_states)
            assert feats.dtype == torch.bfloat16 and feats.shape == (3, 2, 4)
    finally:
        server.stop(grace=None)


# --------------------------------------------------------------------------------------------
# Tensor conversions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32])
@pytest.mark.parametrize("shape", [(), (1,), (5, 3, 8), (0, 4), (2, 0, 3)])
def test_tensor_round_trip(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=gen).mul(100).to(dtype)
    else:
        x = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen).to(dtype)
    msg = tensor_to_proto(x)
    assert list(msg.shape) == list(shape)
    assert len(msg.data) == x.numel() * x.element_size()
    y = tensor_from_proto(types_pb2.Tensor.FromString(msg.SerializeToString()))
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(x, y)


def test_tensor_round_trip_is_bit_exact_for_bf16_specials():
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3.0e38, -1.5],
                     dtype=torch.bfloat16)
    y = tensor_from_proto(tensor_to_proto(x))
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_tensor_wire_format_is_little_endian_row_major():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t()  # non-contiguous: serialised in logical order
    msg = tensor_to_proto(x)
    assert msg.dtype == types_pb2.DTYPE_FLOAT32 and list(msg.shape) == [2, 2]
    assert msg.data == struct.pack("<4f", 1.0, 3.0, 2.0, 4.0)
    assert tensor_to_proto(torch.tensor([1], dtype=torch.bfloat16)).data == struct.pack("<f", 1.0)[2:]
    assert tensor_to_proto(torch.tensor([-2], dtype=torch.int64)).data == struct.pack("<q", -2)


def test_tensor_from_proto_is_writable_and_owns_its_memory():
    msg = tensor_to_proto(torch.arange(6, dtype=torch.int32))
    y = tensor_from_proto(msg)
    y += 1
    assert torch.equal(tensor_from_proto(msg), torch.arange(6, dtype=torch.int32))


def test_tensor_to_proto_fills_a_field_in_place():
    feats = types_pb2.ContextFeatures(start_position=4)
    tensor_to_proto(torch.zeros(2, 3), feats.hidden_states)
    assert list(feats.hidden_states.shape) == [2, 3] and feats.hidden_states.dtype == types_pb2.DTYPE_FLOAT32


def test_tensor_conversion_errors_name_the_field():
    with pytest.raises(TypeError, match="float64"):
        tensor_to_proto(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"Tensor\.dtype"):
        tensor_from_proto(types_pb2.Tensor(shape=[1], data=b"\0" * 4))
    with pytest.raises(ValueError, match=r"Tensor\.data: 3 bytes, expected 4"):
        tensor_from_proto(types_pb2.Tensor(dtype=types_pb2.DTYPE_FLOAT32, shape=[1], data=b"\0" * 3))
    with pytest.raises(ValueError, match=r"Tensor\.shape"):
        tensor_from_proto(types_pb2.Tensor(dtype=types_pb2.DTYPE_FLOAT32, shape=[-1], data=b""))
