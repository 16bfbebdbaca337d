"""`pdserve up`'s GPU layout (pdserve/cli/gpu_layout.py): which GPU each worker gets and how each pair moves KV,
worked out without a GPU."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import build_parser
from pdserve.cli.engine_args import UsageError
from pdserve.cli.gpu_layout import Placement, gpu_list, place_workers
from pdserve.cli.up import decode_gpu_share


def test_gpu_list_parses_and_refuses_what_is_not_a_list_of_gpus():
    assert gpu_list("0,1") == (0, 1) and gpu_list("3") == (3,)
    for bad in ("", "a", "0,,1", "-1", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_list(bad)


def test_without_gpu_flags_every_worker_runs_on_the_device():
    assert place_workers("cuda", 2, 1, "auto", 8) == Placement(("cuda",) * 2, ("cuda",))
    assert place_workers("cuda:3", 1, 1, "auto", 8) == Placement(("cuda:3",), ("cuda:3",))
    assert place_workers("cpu", 1, 2, "tcp", 0) == Placement(("cpu",), ("cpu", "cpu"))


def test_nccl_without_flags_gives_each_worker_a_gpu_of_its_own():
    assert place_workers("cuda", 1, 1, "nccl", 2) == Placement(("cuda:0",), ("cuda:1",))
    assert place_workers("cuda", 2, 1, "nccl", 4) == Placement(("cuda:0", "cuda:1"), ("cuda:2",))
    with pytest.raises(UsageError, match="3 workers need 3 GPUs, this machine has 2"):
        place_workers("cuda", 2, 1, "nccl", 2)


def test_gpus_split_in_halves_prefill_first_and_workers_go_round_robin():
    assert place_workers("cuda", 1, 1, "auto", 2, gpus=(0, 1)) == Placement(("cuda:0",), ("cuda:1",))
    assert place_workers("cuda", 2, 2, "auto", 4, gpus=(0, 1, 2, 3)) == Placement(
        ("cuda:0", "cuda:1"), ("cuda:2", "cuda:3"))
    assert place_workers("cuda", 3, 1, "auto", 4, gpus=(3, 2, 1)) == Placement(
        ("cuda:3", "cuda:2", "cuda:3"), ("cuda:1",))
    one = place_workers("cuda", 1, 1, "auto", 2, gpus=(1,))  # one GPU: both tiers share it
    assert one == Placement(("cuda:1",), ("cuda:1",)) and one.shares_gpu


def test_tier_gpus_explicitly_and_one_tier_taking_the_rest():
    assert place_workers("cuda", 1, 1, "auto", 2, prefill_gpus=(1,), decode_gpus=(0,)) == Placement(
        ("cuda:1",), ("cuda:0",))
    assert place_workers("cuda", 1, 2, "auto", 4, gpus=(0, 1, 2), prefill_gpus=(0,)) == Placement(
        ("cuda:0",), ("cuda:1", "cuda:2"))
    colocated = place_workers("cuda", 2, 2, "auto", 2, prefill_gpus=(0, 1), decode_gpus=(0, 1))
    assert colocated == Placement(("cuda:0", "cuda:1"), ("cuda:0", "cuda:1")) and colocated.shares_gpu
    with pytest.raises(UsageError, match="give --decode-gpus too"):
        place_workers("cuda", 1, 1, "auto", 2, gpus=(0, 1), prefill_gpus=(0, 1))


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=(0, 2)), "--gpus: GPU 2 does not exist"),
    (dict(prefill_gpus=(0,), decode_gpus=(5,)), "--decode-gpus: GPU 5 does not exist"),
    (dict(gpus=(0,), decode_gpus=(1,)), "--decode-gpus names GPUs outside --gpus 0"),
    (dict(gpus=()), "--gpus names no GPU"),
])
def test_bad_gpu_flags_name_the_flag(kwargs, message):
    with pytest.raises(UsageError, match=message):
        place_workers("cuda", 1, 1, "auto", 2, **kwargs)


def test_gpu_flags_off_cuda_and_nccl_on_one_gpu_are_refused():
    with pytest.raises(UsageError, match="--device is cpu"):
        place_workers("cpu", 1, 1, "tcp", 0, gpus=(0,))
    with pytest.raises(UsageError, match="NCCL refuses two ranks on a device"):
        place_workers("cuda", 1, 1, "nccl", 2, gpus=(0,))
    with pytest.raises(UsageError, match="moves KV between GPUs"):
        place_workers("cpu", 1, 1, "nccl", 0)


def test_pair_transports_and_the_start_up_lines():
    layout = place_workers("cuda", 1, 1, "auto", 2, gpus=(0, 1))
    assert not layout.shares_gpu
    assert layout.pair_transport("auto", "cuda:0", "cuda:1") == "cuda_ipc"  # between GPUs of a host: never tcp
    assert layout.describe("auto") == ["prefill worker 0 on cuda:0, decode worker 0 on cuda:1",
                                       "KV cuda:0 -> cuda:1: cuda_ipc across GPUs (auto)"]
    assert layout.describe("nccl")[1] == "KV cuda:0 -> cuda:1: nccl across GPUs"
    cpu = place_workers("cpu", 1, 1, "auto", 0)
    assert cpu.describe("auto")[1] == "KV cpu -> cpu: tcp (auto)"


def test_up_parses_the_gpu_flags_and_paces_decode_only_where_it_shares_a_gpu():
    parser = build_parser()
    args = parser.parse_args(["up", "--gpus", "0,1", "--decode-gpus", "1"])
    assert args.gpus == (0, 1) and args.prefill_gpus is None and args.decode_gpus == (1,)
    apart = place_workers("cuda", 1, 1, "auto", 2, gpus=(0, 1))
    together = place_workers("cuda", 1, 1, "auto", 2, gpus=(0,))
    assert decode_gpu_share(args, apart) == 1.0
    assert decode_gpu_share(args, together) == 1 / 3
    assert decode_gpu_share(parser.parse_args(["up", "--decode-gpu-share", "0.5"]), apart) == 0.5


def test_tensor_parallel_workers_span_runs_of_tp_gpus_and_what_does_not_fit_is_refused():
    # Each tier's GPUs N at a time, each worker on its run's first (its ranks count up from there).
    four = place_workers("cuda", 1, 1, "auto", 8, prefill_gpus=(0, 1, 2, 3), decode_gpus=(4, 5, 6, 7), tp=4)
    assert four == Placement(("cuda:0",), ("cuda:4",), 4) and not four.shares_gpu
    assert four.describe("auto")[0] == "prefill worker 0 on cuda:0-3 (TP4), decode worker 0 on cuda:4-7 (TP4)"
    assert place_workers("cuda", 2, 1, "auto", 4, gpus=(0, 1, 2, 3), tp=2) == Placement(
        ("cuda:0", "cuda:0"), ("cuda:2",), 2)
    # --gpus whose halves are too small for N: both tiers span the whole list, sharing its GPUs.
    both = place_workers("cuda", 1, 1, "auto", 2, gpus=(0, 1), tp=2)
    assert both == Placement(("cuda:0",), ("cuda:0",), 2) and both.shares_gpu
    assert both.span("cuda:0") == ("cuda:0", "cuda:1")
    assert place_workers("cuda", 1, 1, "auto", 2, tp=2) == Placement(("cuda",), ("cuda",), 2)
    refused = [
        (dict(device="cuda:1", tp=2), "--tp 2 runs each worker on 2 GPUs from cuda:1's: GPUs 1-2, and this machine "
                                      "has 2"),
        (dict(prefill_gpus=(0,), decode_gpus=(1,), tp=2), "--tp 2 runs a prefill worker on 2 GPUs; its tier has 1"),
        (dict(prefill_gpus=(0, 2), decode_gpus=(1, 3), gpu_count=4, tp=2),
         "a prefill worker's ranks run on consecutive GPUs from its first, and 0,2 of 0,2 are not"),
        (dict(kv_transport="nccl", tp=2), "--kv-transport nccl puts each worker on its own GPU, --tp 2 on 2"),
        (dict(kv_transport="nccl", gpus=(0, 1), gpu_count=4, tp=2), "cannot pair a prefill and a decode worker on "
                                                                    "one GPU (cuda:0"),
    ]
    for kwargs, message in refused:
        kwargs = {"device": "cuda", "kv_transport": "auto", "gpu_count": 2, **kwargs}
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            place_workers(kwargs.pop("device"), 1, 1, kwargs.pop("kv_transport"), kwargs.pop("gpu_count"), **kwargs)
