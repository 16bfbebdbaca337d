"""The two fronts `pdserve bench` drives: the router's gRPC API (pdserve.v1.Generation) and its OpenAI HTTP API
(streamed /v1/completions). Both time a request the same way: TTFT at the first message that carries tokens; a
message carrying n tokens counts n inter-token gaps of 1/n of its wait each (as SGLang's bench_serving does), so ITL
stays comparable to a decode step; E2E at the message that ends the request.

A client is opened once per run: the first call it makes (GetModelInfo, GET /v1/models) is the check that the target
speaks its protocol, and its failure is the user's error (UsageError, one line) rather than a failed request.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from pdserve.cli.engine_args import UsageError, resolve_model_dir


@dataclass
class Outcome:
    """One request as the client saw it."""

    prompt_len: int
    status: str = "NO_FINAL_STATUS"  # "OK", a gRPC status name or HTTP_<code>; stays this if the stream just stopped
    output_len: int = 0
    ttft: Optional[float] = None
    itls: list[float] = field(default_factory=list)
    e2e: Optional[float] = None
    error: str = ""

    def tokens_arrived(self, n: int, start: float, last: float, now: float) -> None:
        """n tokens in one message at `now`; `last`: when the previous one came."""
        if self.ttft is None:
            self.ttft = now - start
        else:  # n gaps of 1/n each (--stream-interval, a router catching up)
            self.itls.extend([(now - last) / n] * n)


async def one_request(stub, ids: list[int], max_new: int, timeout: float, metadata) -> Outcome:
    """One streamed Generate call on a pdserve.v1.Generation stub."""
    import grpc

    from pdserve.v1 import generate_pb2 as gen_pb

    req = gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=ids),
                                 sampling_params=gen_pb.SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    out = Outcome(len(ids))
    start = last = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
            now = time.perf_counter()
            if msg.HasField("chunk") and msg.chunk.token_ids:
                out.tokens_arrived(len(msg.chunk.token_ids), start, last, now)
                last = now
            elif msg.HasField("complete"):
                out.output_len = len(msg.complete.output_ids)
                out.e2e, out.status = now - start, "OK"
    except grpc.aio.AioRpcError as e:
        out.status, out.error = e.code().name, e.details() or ""
    return out


class GrpcClient:
    """The router's gRPC front, HOST:PORT."""

    backend = "grpc"

    def __init__(self, target: str, api_key: Optional[str], tls_ca: Optional[str]):
        self.target, self.tls_ca = target, tls_ca
        from pdserve.serving.auth import bearer_metadata

        self.metadata = bearer_metadata(api_key)

    async def open(self) -> int:
        """Connects; returns the model's vocabulary size."""
        import grpc

        from pdserve.v1 import generate_pb2 as gen_pb
        from pdserve.v1 import generate_pb2_grpc as gen_grpc

        if self.tls_ca:
            with open(self.tls_ca, "rb") as f:
                self.channel = grpc.aio.secure_channel(self.target, grpc.ssl_channel_credentials(f.read()))
        else:
            self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = gen_grpc.GenerationStub(self.channel)
        try:
            info = await self.stub.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=30, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            await self.channel.close()
            details = e.details() or ""
            hint = (" (an HTTP port: for the OpenAI API give --target http://HOST:PORT)"
                    if "http1.x" in details or "HTTP/2" in details else "")
            raise UsageError(f"--target {self.target}: no pdserve router answers over gRPC there: "
                             f"{e.code().name}: {details}{hint}") from None
        return info.vocab_size

    async def request(self, ids: list[int], max_new: int, timeout: float) -> Outcome:
        return await one_request(self.stub, ids, max_new, timeout, self.metadata)

    async def close(self) -> None:
        await self.channel.close()


class OpenAIClient:
    """The router's OpenAI HTTP front (http://HOST:PORT): streamed /v1/completions with token-id prompts, asking
    for each chunk's token ids (`return_token_ids`, a vLLM extension the router has) so that a chunk's tokens are
    counted as the gRPC client counts them; a server without it counts one token per chunk."""

    backend = "openai"

    def __init__(self, base_url: str, api_key: Optional[str], tls_ca: Optional[str], model_dir: Optional[str]):
        self.base_url, self.tls_ca, self.model_dir = base_url.rstrip("/"), tls_ca, model_dir
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _vocab_size(self) -> int:
        """The OpenAI API does not report the vocabulary: it is read from the model directory's config.json."""
        path = os.path.join(resolve_model_dir(self.model_dir), "config.json")
        with open(path) as f:
            vocab = json.load(f).get("vocab_size")
        if not isinstance(vocab, int) or vocab <= 10:
            raise UsageError(f"--model: {path} has no usable vocab_size (got {vocab!r})")
        return vocab

    async def open(self) -> int:
        """Connects; returns the vocabulary size the prompts' token ids stay below."""
        import aiohttp

        vocab = self._vocab_size()
        ssl = None
        if self.tls_ca:
            import ssl as ssl_module

            ssl = ssl_module.create_default_context(cafile=self.tls_ca)
        # No connection cap of aiohttp's own (100 by default): --max-concurrency is the cap.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=ssl), headers=self.headers)
        url = f"{self.base_url}/v1/models"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise UsageError(f"--target {self.base_url}: GET /v1/models answered HTTP {resp.status}: "
                                     f"{_error_message(body)}")
                self.model = json.loads(body)["data"][0]["id"]
        except UsageError:
            await self.session.close()
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, LookupError, TypeError) as e:
            await self.session.close()
            hint = (" (a gRPC port? bench it as --target HOST:PORT with --backend grpc)"
                    if isinstance(e, (aiohttp.ClientResponseError, aiohttp.ServerDisconnectedError, ValueError))
                    else "")
            what = (f"not an HTTP answer ({str(e.message).splitlines()[0].rstrip(':')})"
                    if isinstance(e, aiohttp.ClientResponseError) else f"{type(e).__name__}: {e}")
            raise UsageError(f"--target {self.base_url}: no OpenAI HTTP API answers there: "
                             f"{' '.join(what.split())}{hint}") from None
        return vocab

    async def request(self, ids: list[int], max_new: int, timeout: float) -> Outcome:
        import aiohttp

        body = {"model": self.model, "prompt": ids, "max_tokens": max_new, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        out = Outcome(len(ids))
        start = last = time.perf_counter()
        counted = 0
        try:
            async with self.session.post(f"{self.base_url}/v1/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    out.status, out.error = f"HTTP_{resp.status}", _error_message(await resp.text())
                    return out
                finished = False
                async for raw in resp.content:  # server-sent events, one `data: ...` line each
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[len(b"data:"):].strip()
                    if data == b"[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        out.status, out.error = f"STREAM_{str(error.get('code') or 'error').upper()}", \
                            str(error.get("message", ""))
                        return out
                    for choice in event.get("choices", ()):
                        n = len(choice["token_ids"]) if "token_ids" in choice else (1 if choice.get("text") else 0)
                        if n:
                            out.tokens_arrived(n, start, last, now)
                            last, counted = now, counted + n
                        if choice.get("finish_reason") is not None:
                            out.e2e, finished = now - start, True
                    if event.get("usage"):
                        out.output_len = event["usage"]["completion_tokens"]
                if finished:
                    out.status = "OK"
                    out.output_len = out.output_len or counted
        except TimeoutError:
            out.status, out.error = "DEADLINE_EXCEEDED", f"no answer within --request-timeout {timeout:g} s"
        except (aiohttp.ClientError, OSError, ValueError) as e:
            out.status, out.error = "CONNECTION_ERROR", f"{type(e).__name__}: {e}"
        return out

    async def close(self) -> None:
        await self.session.close()


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, LookupError, TypeError):
        return body.strip()[:200]


def client_for(args) -> "GrpcClient | OpenAIClient":
    """The client `--target` and `--backend` ask for: a URL (http:// or https://) is the OpenAI front, HOST:PORT
    the gRPC one unless --backend openai."""
    target = args.target
    is_url = target.startswith(("http://", "https://"))
    backend = args.backend or ("openai" if is_url else "grpc")
    if backend == "grpc":
        if is_url:
            raise UsageError(f"--backend grpc dials HOST:PORT, not a URL ({target})")
        return GrpcClient(target, args.api_key, args.tls_ca)
    base = target if is_url else f"{'https' if args.tls_ca else 'http'}://{target}"
    return OpenAIClient(base, args.api_key, args.tls_ca, args.model)
