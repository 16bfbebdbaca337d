"""A stack with every protection on (real processes): TLS on all gRPC links (a self-signed certificate made here),
a shared internal token on the workers and their KV transfer, an API key on the router."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from stack import REPO, Proc, free_port, stop_all

pytestmark = pytest.mark.slow
TOKEN, KEY = "internal-s3cret", "client-key-1"


def self_signed(dir_: Path) -> tuple[Path, Path]:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = dir_ / "cert.pem", dir_ / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def tls_channel(address: str, ca: Path) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes()))


def spawn_tls(role: str, args: list[str], log_dir: Path) -> Proc:
    """Start a pdserve process without waiting for it (see `wait_tls_serving`)."""
    port = free_port()
    log_path = log_dir / f"{role}.log"
    popen = subprocess.Popen([sys.executable, "-m", "pdserve", role, "--port", str(port), *args], cwd=REPO,
                             stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Proc(role, f"127.0.0.1:{port}", popen, 0, log_path)


def wait_tls_serving(proc: Proc, ca: Path) -> Proc:
    deadline = time.monotonic() + 60
    with tls_channel(proc.address, ca) as ch:  # health needs no token
        while True:
            assert proc.popen.poll() is None and time.monotonic() < deadline, proc.log()
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return proc
            except grpc.RpcError:
                time.sleep(0.1)


@pytest.fixture(scope="module")
def secure_stack(tiny_v3_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs-security")
    cert, key = self_signed(logs)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    common = ["--model", str(tiny_v3_dir), "--page-size", "4", "--num-pages", "256", "--internal-token", TOKEN, *tls]
    procs = [spawn_tls("prefill", common, logs),  # their model loads overlap
             spawn_tls("decode", common, logs)]
    try:
        for p in procs:
            wait_tls_serving(p, cert)
        procs.append(spawn_tls("router", ["--model", str(tiny_v3_dir), "--prefill", procs[0].address, "--decode",
                                          procs[1].address, "--internal-token", TOKEN, "--tls-ca", str(cert),
                                          "--api-key", "other-key", "--api-key", KEY, *tls], logs))
        wait_tls_serving(procs[2], cert)
        yield procs, cert
    finally:
        stop_all(procs)


def generate(address, ca, metadata=()):
    req = gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=[5, 6, 7]),
                                 sampling_params=gen_pb.SamplingParams(max_new_tokens=4, ignore_eos=True))
    with tls_channel(address, ca) as ch:
        return list(gen_grpc.GenerationStub(ch).Generate(req, timeout=30, metadata=metadata))


def test_internal_endpoints_require_the_token(secure_stack):
    (prefill, decode, _), ca = secure_stack
    for proc, stub_cls in ((prefill, pb_grpc.PrefillWorkerStub), (decode, pb_grpc.DecodeWorkerStub)):
        with tls_channel(proc.address, ca) as ch:
            stub = stub_cls(ch)
            for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetLoad(pb.GetLoadRequest(), timeout=5, metadata=md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
                assert "--internal-token" in err.value.details()
            assert stub.GetLoad(pb.GetLoadRequest(), timeout=5,
                                metadata=(("authorization", f"Bearer {TOKEN}"),)).num_total_pages == 256
    with tls_channel(decode.address, ca) as ch:  # the streaming call that carries every request's tokens too
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.DecodeWorkerStub(ch).DecodeStream(iter([pb.DecodeStreamRequest(attach=["x"])]), timeout=5,
                                                           metadata=(("authorization", "Bearer wrong"),)))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--internal-token" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # plaintext is not served at all
        with grpc.insecure_channel(decode.address) as ch:
            pb_grpc.DecodeWorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=3,
                                                 metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_router_requires_an_api_key_over_tls(secure_stack):
    (_, _, router), ca = secure_stack
    for md in ((), (("authorization", "Bearer nope"),), (("authorization", f"Bearer {TOKEN}"),)):
        with pytest.raises(grpc.RpcError) as err:
            generate(router.address, ca, md)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--api-key" in err.value.details()
    out = generate(router.address, ca, (("authorization", f"Bearer {KEY}"),))  # prefill -> decode KV: token OK
    assert out[-1].HasField("complete") and len(out[-1].complete.output_ids) == 4


def test_bench_over_tls_with_an_api_key(secure_stack, tmp_path):
    (_, _, router), ca = secure_stack
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--target", router.address, "--tls-ca", str(ca),
                          "--api-key", KEY, "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                          "--no-progress", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())["completed"] == 4


def test_redis_url_with_a_password_is_passed_through(tmp_path):
    """redis://:PASSWORD@host URLs (and rediss:// for TLS) go to redis-py unchanged: AUTH works, a wrong one fails."""
    from redis_server import REDIS_SERVER

    from pdserve.cluster.ownership import OwnershipUnavailable, RedisOwnership

    if not os.path.exists(REDIS_SERVER):
        pytest.skip("needs redis-server")
    port = free_port()
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", "pw",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        store = RedisOwnership(f"redis://:pw@127.0.0.1:{port}/0")
        deadline = time.monotonic() + 10
        while True:
            try:
                store.record("prefill-0", [b"block-a"])
                break
            except OwnershipUnavailable:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        assert store.match([b"block-a"]) == {"prefill-0": 1}
        with pytest.raises(OwnershipUnavailable):
            RedisOwnership(f"redis://:wrong@127.0.0.1:{port}/0").match([b"block-a"])
    finally:
        proc.terminate()
        proc.wait(5)
