"""support/: what the rungs share, beside the method in d3s.py (read the rungs first; come here for a detail).

Both trainers (the floor: none of these imports a module of either wing below; tests/test_layout.py holds it)
  methods.py     which rollouts and tokens a method keeps (LADDER, rows beyond the papers), its N and K at a step
  checks.py      what is refused before any work: the flags together, NaN or inf in a model
  checkpoint.py  a run's start, fresh or resume (decided once for both), what a checkpoint holds and a resume restores
  run.py         a run's life around its steps: its folder, metrics.jsonl, the history the rules read, the cadences
  stops.py       how a run stops: a preemption notice, Ctrl-C, a full disk, a bad input (one line, an exit code)
  mathtask.py    the math task: its problems (files, generated tasks), prompts that fit, train_full's inputs and order
  templates.py   how a problem becomes a prompt (--template: qwen-math, chat, plain) and the tokens that end a response
  grading.py     how an answer is scored (the math-verify grader pool), Pass@k, the held-out evaluations
  reward_function.py  --reward: your reward function (TRL's form) in place of math-verify, run in the grader's pool
  explain.py     the explain pages: which rollouts and tokens each rung's page of a step shows
  page.py        how such a page is drawn: the P x G grid and the shown rollouts' tokens, as HTML and PNG
  cli.py         the flags: argparse whose errors are one line, a knob a line
  pool.py        independent jobs in a pool of processes (the toy's methods x seeds)
  track.py       where a run's metrics go besides metrics.jsonl: TensorBoard, wandb, trackio (--report-to)
train_small.py
  sampler.py     the KV-cache sampler and the forward that shares each prompt's keys and values (its fast path)
  warmstart.py   the model and its warm start: the supervised phase, its cache and the shipped weights
  tiny.py        a tiny Qwen2 and a character tokenizer built offline (also the tests')
train_full.py
  fsdp.py        the policy as FSDP2 shards over the ranks, and the ranks' collectives
  loss_head.py   the forwards on the kept rollouts, the LM head only where the loss needs it
  engines.py     the rollouts: vLLM (and HF generate), how the trainer's weights reach vLLM, what the machine must have
  gpu.py         what a run needs of the GPU (the memory plan) and what a step reports of it (clocks, MFU, its line)
"""
