"""support/: what the rungs share, beside the method in d3s.py (read the rungs first; come here for a detail).

cli.py        the flags: argparse whose errors are one line, and the checks the rungs share
methods.py    which rollouts and tokens a method keeps (LADDER, rows beyond the papers) and its N and K at a step
common.py     the loop's plumbing: checkpoints, metrics lines, Ctrl-C and preemption, prompts that fit
mathtask.py   the math task: its problems (files, generated tasks), prompts, and train_full's prompt order and seeds
grading.py    how an answer is scored (the math-verify grader pool), Pass@k and the held-out evaluations
tiny.py       a tiny Qwen2 and a character tokenizer built offline (tests and the CPU rungs)
warmstart.py  train_small.py's model and warm start: the supervised phase, its cache and the shipped weights
explain.py    the explain pages: one step's selections drawn as HTML and PNG
fsdp.py       train_full.py's policy as FSDP2 shards over the ranks, and the ranks' collectives
loss_head.py  train_full.py's forwards on the kept rollouts, the LM head only where the loss needs it
engines.py    train_full.py's rollouts: vLLM (and HF generate), and how the trainer's weights reach vLLM
gpu.py        what a run needs of the GPU (the memory plan) and what a step reports of it (clocks, MFU)
full_io.py    train_full.py's input and output: data, evaluation, checkpoints, export
"""
