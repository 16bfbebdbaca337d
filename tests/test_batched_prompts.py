"""Batched prompts on /v1/completions (issue 49, item 1), against `pdserve up` on the demo model: `prompt` as a list of
strings or of token-id lists (as OpenAI and vLLM take it) is answered one choice per prompt and sample, choice
i*n + j being prompt i's j-th, each equal to the same prompt sent alone; `usage` adds them up; streamed chunks say
whose tokens they carry. And lm-eval 0.4.13 itself, with --batch_size 4 and its tokenizer on the client side (item 4:
the tokenizer a client loads encodes as the server does), scores each continuation as a text request scores it."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

from stack import REPO

pytestmark = pytest.mark.slow
MODEL = "tiny-trained"
TEXTS = ["def add(a, b):", "import os\nimport", "Hello"]
IDS = [[0, 5, 6, 7, 8], [0, 9, 10], [0, 11, 12, 13, 14, 15]]
TOL = 1e-4


@pytest.fixture(scope="module")
def up(demo_up):
    return demo_up.get()  # (conftest.py: the session's `pdserve up` on the demo model)


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{up.http_port}/v1", api_key="unused", max_retries=0, timeout=60)


def post(up, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{up.http_port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("prompts", [TEXTS, IDS], ids=["strings", "token-ids"])
def test_a_list_of_prompts_is_answered_per_prompt_in_index_order(client, prompts):
    n = 2
    kwargs = dict(max_tokens=5, temperature=0.8, seed=7, n=n, extra_body={"ignore_eos": True, "return_token_ids": True})
    got = client.completions.create(model=MODEL, prompt=prompts, **kwargs)
    assert [c.index for c in got.choices] == list(range(len(prompts) * n))
    alone = [client.completions.create(model=MODEL, prompt=p, **kwargs) for p in prompts]
    for i, single in enumerate(alone):
        for j in range(n):  # sampled with the seed: a choice mixed up with another would differ
            batched = got.choices[i * n + j]
            assert (batched.text, batched.model_extra["token_ids"]) == \
                (single.choices[j].text, single.choices[j].model_extra["token_ids"]), (i, j)
    assert got.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in alone)
    assert got.usage.completion_tokens == len(prompts) * n * 5
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    stream = client.completions.create(model=MODEL, prompt=prompts, stream=True,
                                       stream_options={"include_usage": True}, **kwargs)
    texts, usage = collections.defaultdict(str), None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert [texts[k] for k in range(len(prompts) * n)] == [c.text for c in got.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (got.usage.prompt_tokens, got.usage.completion_tokens)


def test_echo_and_logprobs_are_each_prompts_own(up, client):
    """The body lm-eval's local-completions sends to score continuations (echo, logprobs 1, one new token), with
    several prompts: each choice's echo and prompt logprobs are its own prompt's; streamed, each echo chunk too."""
    body = {"model": MODEL, "prompt": IDS, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    status, got = post(up, body)
    assert status == 200, got
    choices = sorted(got["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    streamed = client.completions.create(**{**body, "stream": True})
    echoes = collections.defaultdict(list)
    for chunk in streamed:
        for c in chunk.choices:
            echoes[c.index].append(c.logprobs.tokens if c.logprobs else [])
    for i, ids in enumerate(IDS):
        single = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                           echo=True, seed=1234).choices[0]
        lp = choices[i]["logprobs"]
        assert choices[i]["text"] == single.text and lp["tokens"] == single.logprobs.tokens
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        diffs = [abs(a - b) for a, b in zip(lp["token_logprobs"][1:], single.logprobs.token_logprobs[1:])]
        assert max(diffs) <= TOL, (i, diffs)
        assert lp["top_logprobs"][1:] == [pytest.approx(t, abs=TOL) for t in single.logprobs.top_logprobs[1:]]
        assert [t for tokens in echoes[i] for t in tokens] == single.logprobs.tokens


@pytest.mark.parametrize("prompt, n, needle", [
    (["x"] * 257, 1, "at most 256 prompts per request (got 257)"),
    (["def", [5, 6]], 1, "prompt[1]: a batch is all strings or all token-id lists"),
    ([[5, 6], []], 1, "prompt[1]: the prompt is empty"),
    ([[5, 6], [5, "6"]], 1, "prompt[1] must be a list of token ids"),
    ([[5, 6], [1, 10_000_000]], 1, "prompt[1]: token ids out of the vocabulary"),
    (["x"] * 100, 16, "100 prompts x n=16 are 1600 generations; this router runs at most 1024"),
])
def test_batches_beyond_the_limits_are_400s_naming_the_prompt(up, prompt, n, needle):
    status, body = post(up, {"model": MODEL, "prompt": prompt, "n": n, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt" and needle in body["error"]["message"], body


# `lm_eval --model local-completions --model_args A --tasks pdserve_tiny --include_path P --batch_size 4
# --output_path O --log_samples`, as its CLI runs it (lm_eval/_cli/run.py: simple_evaluate, then the tracker writes the
# samples), with a task manager that looks up only P's tasks: the CLI's indexes every bundled task's YAML first, most
# of the run's time on two cores and nothing this test looks at.
LM_EVAL_RUN = """
import sys

from lm_eval import simple_evaluate
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager

model_args, include_path, out = sys.argv[1:]
tracker = EvaluationTracker(output_path=out)
results = simple_evaluate(model="local-completions", model_args=model_args, tasks=["pdserve_tiny"], batch_size=4,
                          log_samples=True, evaluation_tracker=tracker,
                          task_manager=TaskManager(include_path=include_path, include_defaults=False))
samples = results.pop("samples")
tracker.save_results_aggregated(results=results, samples=samples)
for task in results["configs"]:
    tracker.save_results_samples(task_name=task, samples=samples[task])
"""


def test_lm_eval_batch_size_4_scores_as_text_requests_do(up, client, tmp_path):
    """lm-eval 0.4.13's local-completions model, offline, with --batch_size 4 (four token-id prompts a request) and
    add_bos_token=True (its Hugging Face tokenizer adds what tokenizer.json says): every continuation's loglikelihood
    equals the one a text request of context + continuation gives, the server tokenizing it."""
    from transformers import AutoTokenizer

    docs = [{"context": "def add(a, b):\n    return", "choices": ["a + b", "a - b", "None"], "label": 0},
            {"context": "import os\nimport", "choices": ["sys", "123", "("], "label": 0},
            {"context": "for i in range(", "choices": ["10):", "):", "x"], "label": 0},
            {"context": "if x is None:", "choices": ["\n    return None", " pass", "]"], "label": 0}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "pdserve_tiny.yaml").write_text(
        "task: pdserve_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'docs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    model_args = (f"model={MODEL},base_url=http://127.0.0.1:{up.http_port}/v1/completions,"
                  f"tokenizer={REPO / 'models' / 'tiny-trained'},tokenizer_backend=huggingface,"
                  "tokenized_requests=True,add_bos_token=True")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-c", LM_EVAL_RUN, model_args, str(tmp_path), str(tmp_path / "out")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [samples] = list((tmp_path / "out").rglob("samples_pdserve_tiny_*.jsonl"))
    tok = AutoTokenizer.from_pretrained(str(REPO / "models" / "tiny-trained"))
    scored = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for args, resp in zip(sample["arguments"].values(), sample["filtered_resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            spaces = len(context) - len(context.rstrip())  # lm-eval moves them to the continuation
            context_ids = tok(context[:len(context) - spaces]).input_ids
            text = context + continuation
            want = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0, logprobs=1,
                                             echo=True).choices[0].logprobs.token_logprobs
            assert len(want) == len(tok(text).input_ids) + 1  # the server encoded the text as the client does
            assert float(resp[0]) == pytest.approx(sum(want[len(context_ids):-1]), abs=TOL), (context, continuation)
            scored += 1
    assert scored == sum(len(d["choices"]) for d in docs)
