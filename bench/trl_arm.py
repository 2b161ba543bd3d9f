"""bench/trl_arm.py: the TRL arms of bench/vs_trl.py, a minimal trl.GRPOTrainer run, timed.

It runs in the TRL venv (TRL is not a dependency of the project's own .venv):

    python3 -m venv .venv-trl && .venv-trl/bin/pip install -r requirements/trl.txt
    .venv-trl/bin/python bench/trl_arm.py --model WARM_START_FOLDER --train-file train.jsonl \\
        --eval-file eval.jsonl --out runs/bench_vs_trl/trl --steps 20 --prompts-per-step 16 --group-size 16
    .venv-trl/bin/python bench/trl_arm.py ... --d3s-method d3s --n-init 4 --n-final 16   # TRL + D3S

With --d3s-method the trainer is integrations/trl.py's D3SGRPOTrainer (D3SGRPOConfig: the same
GRPOConfig plus d3s_method, n_init, n_final, k_init, k_final); everything else is unchanged.

bench/vs_trl.py passes the same values to this script and to train_small.py. The run is
matched to `train_small.py --method grpo` as closely as TRL allows:
  - the same model folder (AutoModelForCausalLM, fp32, CPU) and its tokenizer;
  - the same prompts at every step: the dataset lists, step after step, the P problems that
    train_small.py draws at that step (random.Random(step_seed(seed, step)).sample), and TRL's
    sampler is told not to shuffle (shuffle_dataset=False), so it takes them in that order and
    repeats each G times (--same-prompts off: TRL shuffles the training file with --seed);
  - the same sampling noise: torch.manual_seed(step_seed(seed, step)) right before each
    generate call, as train_small.py does at the start of each step, so with the same weights
    and the same batch both draw the same rollouts (checked by vs_trl.py at step 1);
  - prompts are plain strings (mathtask templates applied here), so TRL applies no chat template;
  - reward = grading.Grader (last \\boxed{} vs `answer`, math-verify, hard time limit);
  - GRPOConfig: num_generations = G, per_device_train_batch_size = P x G (one optimizer step
    and one loss micro-batch per generation batch), num_iterations = 1, beta = 0 (no reference
    model), scale_rewards = "group", loss_type = "dapo" (TRL's default: token mean over the
    batch, which is d3s.policy_loss's "token-mean"), epsilon 0.2, constant learning rate, no
    warmup, no weight decay, AdamW, grad-norm clipping, temperature, top_k = 0, top_p = 1,
    use_vllm = False (HF generate), bf16 = False (GRPOConfig's default is True; the project
    trains in fp32), report_to none, no evaluation during training;
  - gradient_checkpointing: TRL's default (True) unless --gradient-checkpointing off. It is not
    part of the algorithm: it recomputes each decoder layer's forward during backward (an
    extra backbone forward per step) to save activation memory; train_small.py does not.
  - held-out evaluation with train_small.evaluate itself (greedy Pass@1 over the same eval
    rows, the same Grader), before and after training.

Timing (perf_counter seconds per optimizer step), from a GRPOTrainer subclass and a callback:
  gen_s     GRPOTrainer._generate: tokenize, model.generate, decode (= train_small's gen_s)
  reward_s  GRPOTrainer._calculate_rewards: the Grader (= train_small's reward_s)
  prep_s    all of GRPOTrainer._generate_and_score_completions (gen + reward + padding,
            advantages, metric bookkeeping; with beta = 0, num_iterations = 1 and no gradient
            accumulation TRL 1.16 runs no extra no-grad forward there)
  step_s    on_step_begin -> on_step_end of the HF Trainer loop: prep + loss forward/backward
            + grad clipping + optimizer step + zero_grad
  update_s  step_s - gen_s - reward_s (= train_small's train_s, plus TRL's bookkeeping)
  outside_s on_step_end -> next on_step_begin: TRL's per-step logging and dataloader
  update_s is also split into prep_other_s (prep_s - gen_s - reward_s), loss_fwd_s
  (compute_loss), backward_s (training_step - prep - compute_loss) and optim_s (clip + AdamW +
  zero_grad + callbacks: step_s - training_step)
Writes OUT/metrics.jsonl (one row per step) and OUT/result.json.
"""

import argparse
import json
import os
import platform
import random
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="model folder (save_pretrained), e.g. train_small's warm start")
    p.add_argument("--train-file", required=True, help="JSONL with problem/answer (training prompts)")
    p.add_argument("--eval-file", required=True, help="JSONL with problem/answer (held-out)")
    p.add_argument("--out", required=True, help="output folder (metrics.jsonl, result.json)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=16, help="G: completions per prompt (num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="max_completion_length")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--loss-type", default="dapo", help="TRL loss_type (dapo/bnpo = token mean over the batch)")
    p.add_argument("--scale-rewards", default="group", help="TRL scale_rewards: group (GRPO) or none (Dr. GRPO)")
    p.add_argument("--template", default="plain", choices=["plain", "qwen-math"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int, default=None, help="first N rows of --train-file (as train_small)")
    p.add_argument("--eval-size", type=int, default=None, help="first N rows of --eval-file (as train_small)")
    p.add_argument("--eval-samples", type=int, default=1, help="train_small.evaluate's n (sampled Pass@1)")
    p.add_argument("--gen-batch", type=int, default=512, help="sequences per generate call in evaluation")
    p.add_argument(
        "--no-same-prompts",
        dest="same_prompts",
        action="store_false",
        help="let TRL shuffle the training file instead of replaying train_small's prompt order",
    )
    p.add_argument(
        "--gradient-checkpointing",
        default="on",
        choices=["on", "off"],
        help="GRPOConfig.gradient_checkpointing: on is TRL's default (recomputes every decoder layer's "
        "forward during backward); off matches train_small.py",
    )
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument(
        "--d3s-method",
        default=None,
        help="train with integrations/trl.py's D3SGRPOTrainer and this "
        "methods.LADDER row (e.g. d3s); default: TRL's own GRPOTrainer",
    )
    p.add_argument("--n-init", type=int, default=None, help="D3SGRPOConfig.n_init (default G/4)")
    p.add_argument("--n-final", type=int, default=None, help="D3SGRPOConfig.n_final (default G)")
    p.add_argument("--k-init", type=float, default=0.05, help="D3SGRPOConfig.k_init")
    p.add_argument("--k-final", type=float, default=0.20, help="D3SGRPOConfig.k_final")
    return p.parse_args(argv)


def prompt_schedule(train_rows, steps, P, seed):
    """The problems train_small.train_step draws, step after step (P per step, prompt-major)."""
    from train_small import step_seed

    rows = []
    for step in range(1, steps + 1):
        rows += random.Random(step_seed(seed, step)).sample(train_rows, min(P, len(train_rows)))
    return rows


def peak_rss_mb():
    """Peak resident set of this process (VmHWM), MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import train_small
    from support import mathtask
    from support.grading import Grader
    from support.mathtask import load_problems

    if args.d3s_method:
        from integrations.trl import D3SGRPOConfig as GRPOConfig  # noqa: F811
        from integrations.trl import D3SGRPOTrainer as GRPOTrainer  # noqa: F811

        d3s_fields = {
            "d3s_method": args.d3s_method,
            "n_init": args.n_init,
            "n_final": args.n_final,
            "k_init": args.k_init,
            "k_final": args.k_final,
        }
    else:
        d3s_fields = {}
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    train_rows, _ = load_problems(args.train_file, limit=args.train_size)
    eval_rows, _ = load_problems(args.eval_file, limit=args.eval_size)
    P, G = args.prompts_per_step, args.group_size
    if args.same_prompts:
        rows = prompt_schedule(train_rows, args.steps, P, args.seed)
        P = len(rows) // args.steps
    else:
        rows = train_rows
    dataset = Dataset.from_dict(
        {
            "prompt": [mathtask.format_prompt(r["problem"], args.template) for r in rows],
            "answer": [r["answer"] for r in rows],
        }
    )

    transformers.set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    grader = Grader()
    eval_args = SimpleNamespace(
        seed=args.seed,
        rl_seed=args.seed,
        template=args.template,  # rl_seed: train_small's
        eval_samples=args.eval_samples,
        mid_eval_samples=args.eval_samples,
        steps=args.steps,
        pass_k=1,
        gen_batch=args.gen_batch,  # --rl-seed
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    eval0 = train_small.evaluate(model, tokenizer, grader, eval_rows, 0, eval_args)

    def math_reward(prompts, completions, answer, **kwargs):
        return grader.score_batch(completions, answer)

    config = GRPOConfig(
        output_dir=os.path.join(args.out, "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=args.max_grad_norm,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type=args.loss_type,
        scale_rewards=args.scale_rewards,
        shuffle_dataset=not args.same_prompts,
        use_vllm=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=1,
        report_to="none",
        eval_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        **d3s_fields,
    )

    timings = {k: 0.0 for k in ("gen_s", "reward_s", "prep_s", "loss_fwd_s", "training_step_s")}

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with timers (and train_small's per-step sampling seed) around its stages."""

        def _generate_single_turn(self, *a, **kw):
            if args.same_prompts:  # train_small.train_step: torch.manual_seed(step_seed(seed, step)), then generate
                torch.manual_seed(train_small.step_seed(args.seed, self.state.global_step + 1))
            return super()._generate_single_turn(*a, **kw)

        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                timings["gen_s"] += time.perf_counter() - t0

        def _calculate_rewards(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                out = super()._calculate_rewards(*a, **kw)
            finally:
                timings["reward_s"] += time.perf_counter() - t0
            timings["reward_mean"] = float(out.mean())
            return out

        def compute_loss(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super().compute_loss(*a, **kw)
            finally:
                timings["loss_fwd_s"] += time.perf_counter() - t0

        def training_step(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super().training_step(*a, **kw)
            finally:
                timings["training_step_s"] += time.perf_counter() - t0

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                timings["prep_s"] += time.perf_counter() - t0
            timings["gen_tokens"] = int(out["completion_mask"].sum())
            timings["response_len"] = timings["gen_tokens"] / out["completion_mask"].shape[0]
            return out

    rows_out = []
    metrics_file = open(os.path.join(args.out, "metrics.jsonl"), "w")

    class StepTimer(TrainerCallback):
        t_end = None

        def on_step_begin(self, a, state, control, **kw):
            self.outside_s = time.perf_counter() - self.t_end if self.t_end is not None else None
            for k in ("gen_s", "reward_s", "prep_s", "loss_fwd_s", "training_step_s"):
                timings[k] = 0.0
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.t_end = time.perf_counter()
            step_s = self.t_end - self.t0
            row = {
                "kind": "train",
                "step": state.global_step,
                "gen_s": timings["gen_s"],
                "reward_s": timings["reward_s"],
                "prep_s": timings["prep_s"],
                "update_s": step_s - timings["gen_s"] - timings["reward_s"],
                "step_s": step_s,
                "outside_s": self.outside_s,
                # update_s split: TRL's other batch prep, loss forward, backward, clip + AdamW + zero_grad
                "prep_other_s": timings["prep_s"] - timings["gen_s"] - timings["reward_s"],
                "loss_fwd_s": timings["loss_fwd_s"],
                "backward_s": timings["training_step_s"] - timings["prep_s"] - timings["loss_fwd_s"],
                "optim_s": step_s - timings["training_step_s"],
                "reward_mean": timings.get("reward_mean"),
                "gen_tokens": timings.get("gen_tokens"),
                "response_len": timings.get("response_len"),
                "rss_mb": peak_rss_mb(),
            }
            rows_out.append(row)
            self.pending = row  # written by on_log, which follows with the step's logged metrics

        def on_log(self, a, state, control, logs=None, **kw):
            row, self.pending = getattr(self, "pending", None), None
            if row is None:
                return
            logs = logs or {}
            row["loss_tokens"] = logs.get("kept_tokens", row["gen_tokens"])  # tokens in the loss
            row["fwd_tokens"] = logs.get("fwd_tokens", row["gen_tokens"])  # response tokens forwarded with grad
            row["kept_rollouts"] = logs.get("kept_samples", P * G)
            for key in (
                "n_keep",
                "k_frac",
                "k_real",
                "sur",
                "loss",
                "grad_norm",
            ):
                if key in logs:
                    row[key] = logs[key]
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()

    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[math_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    t_train = time.perf_counter()
    trainer.train()
    train_wall_s = time.perf_counter() - t_train
    metrics_file.close()

    final = train_small.evaluate(trainer.model, tokenizer, grader, eval_rows, args.steps, eval_args)
    grader.close()
    result = {
        "arm": "trl",
        "steps": len(rows_out),
        "prompts_per_step": P,
        "group_size": G,
        "eval_greedy_pass1_step0": eval0["eval_greedy_pass1"],
        "eval_greedy_pass1": final["eval_greedy_pass1"],
        "eval_pass1_mean": final["eval_pass1_mean"],
        "eval_n": len(eval_rows),
        "eval_s": eval0["eval_s"] + final["eval_s"],
        "train_wall_s": train_wall_s,
        "total_wall_s": time.perf_counter() - t_start,
        "peak_rss_mb_self": peak_rss_mb(),
        "torch_threads": torch.get_num_threads(),
        "grader_timeouts": grader.timeouts,
        "same_prompts": args.same_prompts,
        "d3s": d3s_fields or None,
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "config": {
            k: getattr(config, k)
            for k in (
                "per_device_train_batch_size",
                "num_generations",
                "max_completion_length",
                "temperature",
                "top_k",
                "top_p",
                "learning_rate",
                "beta",
                "num_iterations",
                "loss_type",
                "scale_rewards",
                "epsilon",
                "max_grad_norm",
                "lr_scheduler_type",
                "steps_per_generation",
                "gradient_accumulation_steps",
                "shuffle_dataset",
                "seed",
                "gradient_checkpointing",
                "bf16",
            )
        },
    }
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {k: result[k] for k in ("arm", "steps", "eval_greedy_pass1_step0", "eval_greedy_pass1", "train_wall_s")}
        )
    )
    return result


if __name__ == "__main__":
    main()
