"""tests/trl_worker.py: a D3SGRPOTrainer run that records what it selected, for test_integration_trl.py.

    python tests/trl_worker.py --model DIR --out result.pt                                   # one process
    python -m torch.distributed.run --nproc_per_node=2 tests/trl_worker.py --model DIR --out result.pt   # two (gloo)

The test module imports the same pieces (PROMPTS, parity_reward, make_config, RecordingTrainer)
to run in-process. Runs in the TRL venv (.venv-trl, requirements/trl.txt).

Recorded per generation batch, in global row order (row r = process i's row j with r = i * B + j):
the rewards of all rollouts, the kept mask and advantages, the prompt/completion tensors; per
loss call, the global row ids of the kept rows and the token mask d3s.policy_loss received.
With --seeded-generation each rollout is sampled alone, seeded by (step, global row), so one and
two processes draw the very same rollouts and the selections can be compared. --flat-rows STEP:START:END
gives global rows START..END-1 of that step reward 1 (no spread: DAPO's filter drops their groups).
"""

import argparse
import copy
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import d3s  # noqa: E402
from integrations.trl import D3SGRPOConfig, D3SGRPOTrainer  # noqa: E402

PROMPTS = [f"{a}+{b}=" for a in range(8) for b in range(8)]


def parity_reward(completions, **kwargs):
    """0/1: the parity of the number of odd character codes (about half the rollouts score 1)."""
    return [float(sum(ord(ch) % 2 for ch in c) % 2) for c in completions]


def half_flat_reward(prompts, completions, **kwargs):
    """parity_reward on the prompts whose first operand is odd, 0 on the others: their groups have no spread
    (DAPO's filter drops them), the others have spread unless all 4 rollouts share a parity (1 in 8)."""
    return [parity_reward([c])[0] if int(p[0]) % 2 else 0.0 for p, c in zip(prompts, completions)]


def flat_reward(completions, **kwargs):
    """1 for every rollout: no group has spread."""
    return [1.0] * len(completions)


def signal_then_flat_reward(completions, trainer_state, **kwargs):
    """parity_reward on the first step (global_step 0), flat_reward after it."""
    return parity_reward(completions) if trainer_state.global_step == 0 else flat_reward(completions)


def make_config(out, config_class=D3SGRPOConfig, **overrides):
    """A small CPU config: 4 prompts x 4 rollouts per step, 8 new tokens, plain fp32 AdamW.
    config_class=trl.GRPOConfig gives the same run without the D3S fields (TRL's own trainer)."""
    kwargs = dict(
        output_dir=out,
        max_steps=3,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    if config_class is D3SGRPOConfig:
        kwargs["d3s_method"] = "d3s"
    kwargs.update(overrides)
    return config_class(**kwargs)


class RecordingTrainer(D3SGRPOTrainer):
    """D3SGRPOTrainer that keeps what each step selected (see the module docstring)."""

    seeded_generation = False
    flat_rows = {}  # {global_step: (start, end)}: these global rows get reward 1 on that step

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches, self.losses = [], []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self.seeded_generation:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        completions = []
        first = self.accelerator.process_index * len(prompt_ids)
        with torch.no_grad():
            for j, ids in enumerate(prompt_ids):  # one rollout at a time: no padding, its own seed
                torch.manual_seed(1000 * self.state.global_step + first + j)
                out = self.model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    generation_config=self.generation_config,
                )[0, len(ids) :].tolist()
                end = next((t + 1 for t, tok in enumerate(out) if tok in self.eos_token_ids), len(out))
                completions.append(out[:end])
        return completions, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # [B_global, n_funcs]
        if self.state.global_step in self.flat_rows:  # rows in process order: process i's are [i * B, (i + 1) * B)
            start, end = self.flat_rows[self.state.global_step]
            rewards[start:end] = 1.0
        return rewards

    def _generate_and_score_completions(self, inputs):
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}  # what generated and is scored
        adam = copy.deepcopy(self.optimizer.state_dict()["state"]) if self.optimizer is not None else {}  # AdamW's, too
        output = super()._generate_and_score_completions(inputs)
        B = output["completion_ids"].shape[0]
        output["row_id"] = torch.arange(B) + self.accelerator.process_index * B  # global row, follows the shuffle
        self.batches.append(
            {
                "step": self.state.global_step,
                "rewards": self._global_rewards(),
                "weights": weights,
                "adam": adam,
                "k_frac": float(output["d3s_k_frac"]),
                "row_id": output["row_id"].clone(),
                **{
                    k: output[k].detach().clone()
                    for k in (
                        "prompt_ids",
                        "prompt_mask",
                        "completion_ids",
                        "completion_mask",
                        "advantages",
                        "d3s_keep",
                    )
                },
            }
        )
        return output

    def _compute_loss(self, model, inputs):
        calls = []
        real = d3s.policy_loss

        def recording_policy_loss(logp, old_logp, adv, token_mask, *args, **kwargs):  # the real loss, its tokens kept
            calls.append(
                {"mask": token_mask.detach().clone(), "adv": adv.detach().clone(), "normalizer": kwargs["normalizer"]}
            )
            return real(logp, old_logp, adv, token_mask, *args, **kwargs)

        d3s.policy_loss = recording_policy_loss
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            d3s.policy_loss = real
        rows = inputs["d3s_keep"].nonzero().view(-1)
        self.losses.append(
            {
                "step": self.state.global_step,
                "row_id": inputs["row_id"][rows].clone(),
                "calls": calls,
                "loss": float(loss.detach()),
            }
        )
        return loss


def kept_tokens_by_row(trainer):
    """{(step, global row): token mask over the completion [T] (bool)} from the recorded loss calls."""
    out = {}
    for rec in trainer.losses:
        for call in rec["calls"]:
            for r, m in zip(rec["row_id"].tolist(), call["mask"].bool()):
                out[(rec["step"], r)] = m
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--method", default="d3s")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows-per-process", type=int, default=16, help="per_device_train_batch_size")
    p.add_argument(
        "--flat-rows",
        nargs="*",
        default=[],
        metavar="STEP:START:END",
        help="global rows START..END-1 of step STEP get reward 1",
    )
    args = p.parse_args(argv)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = make_config(
        os.path.join(os.path.dirname(args.out), "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.rows_per_process,
        d3s_method=args.method,
    )
    RecordingTrainer.seeded_generation = True
    RecordingTrainer.flat_rows = {
        int(step): (int(start), int(end)) for step, start, end in (spec.split(":") for spec in args.flat_rows)
    }
    trainer = RecordingTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=parity_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    trainer.train()

    from accelerate.utils import gather_object

    keep = {
        (b["step"], r): bool(k) for b in trainer.batches for r, k in zip(b["row_id"].tolist(), b["d3s_keep"].tolist())
    }
    completions = {
        (b["step"], r): c[m.bool()].tolist()
        for b in trainer.batches
        for r, c, m in zip(b["row_id"].tolist(), b["completion_ids"], b["completion_mask"])
    }
    tokens = {key: m.tolist() for key, m in kept_tokens_by_row(trainer).items()}
    mine = {
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "adam_steps": sorted({int(st["step"]) for st in trainer.optimizer.state.values()}),
    }  # [] if it never stepped
    gathered = gather_object([{"keep": keep, "completions": completions, "tokens": tokens, "process": mine}])
    if trainer.accelerator.is_main_process:
        merged = {
            name: {k: v for part in gathered for k, v in part[name].items()}
            for name in ("keep", "completions", "tokens")
        }
        merged["rewards"] = [b["rewards"] for b in trainer.batches]
        merged["params"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        merged["per_process"] = [part["process"] for part in gathered]  # params and AdamW's step counts of each
        merged["weights_before"] = [b["weights"] for b in trainer.batches]  # before each step's generation
        merged["processes"] = trainer.accelerator.num_processes
        merged["log_history"] = trainer.state.log_history
        torch.save(merged, args.out)


if __name__ == "__main__":
    main()
