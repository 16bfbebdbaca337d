"""Workers that span devices: tensor parallelism (TP).

A worker started with tp_size N runs N ranks, one process and one device each. Rank 0 is the engine a user or a
tier talks to: it owns the scheduler, the loop, sampling (and, in a tier, the gRPC service and the KV transport);
it hands each model call's inputs to ranks 1..N-1, which loop on them (nano-vllm's ModelRunner.loop) and decide
nothing themselves. The model is the same file on every rank; its layers split themselves:

  group.py   TPGroup: this rank, the group size and the collectives (Gloo on the CPU, NCCL on GPUs)
  linear.py  ColumnParallelLinear, RowParallelLinear (+ all-reduce), each loading only its shard
  dp_attention.py  DP attention: each rank attends over its own requests, the MLP/MoE over every rank's tokens
  steps.py   what rank 0 hands the other ranks per model call: a header through a pipe, tensors by broadcast
  driver.py  rank 0's handle on the model: every call announced to the other ranks, then run
  ranks.py   rank 0 starts, watches and stops the other ranks; a dead rank ends the worker (RankDied)
  worker.py  ranks 1..N-1: build the same model shards, pool and graphs, then loop on rank 0's calls
"""
