"""integrations/trl.py: D3S inside TRL's GRPOTrainer. Change one import and a few config fields.

    from integrations.trl import D3SGRPOConfig, D3SGRPOTrainer    # was: from trl import GRPOConfig, GRPOTrainer

    args = D3SGRPOConfig(..., d3s_method="d3s", n_init=4, n_final=16, k_init=0.05, k_final=0.20)
    trainer = D3SGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)
    trainer.train()

Everything else is TRL's: generation (HF generate, vLLM colocate or server), reward functions,
the HF Trainer loop (gradient accumulation, DDP/FSDP/DeepSpeed through accelerate, checkpoints,
callbacks, logging). Inside TRL's step, every D3S piece is a call into d3s.py (docs/algorithm.md,
section 6):

  1 rewards   TRL's reward functions, weighted and gathered from every process ([P * G] rollouts)
  2 samples   d3s.select_samples(rewards [P, G] of the GLOBAL batch, N, method) with (N, K) from
              d3s.method_budget at TRL's global step over max_steps; every process keeps its own
              rows of the global choice. The advantages for the loss are the ones select_samples
              returns (d3s.group_advantages with TRL's eps 1e-4; PODS recomputes them on the kept N).
  3 forward   only the kept completions go through the model with grad: TRL's own forward and fused
              LM head, which returns the log-probs and the entropy of the same logits
              (H = log Z - E_pi[z], exact, as d3s.token_entropy; the [B, T, V] logits are never held)
  4 tokens    scores |A| * H of every process gathered -> d3s.select_tokens once: one top K over
              the optimizer batch of all processes (scope "batch"; "sequence" is the alternative)
  5 loss      d3s.policy_loss on the selected tokens; the normalizer (selected tokens of the
              optimizer batch, summed over processes) is fixed before the backward, so the number
              of processes and gradient accumulation do not change the update
  6 step      none where no process selected a token in the whole optimizer step (DAPO's filter
              with no group with spread), as in train_full.py and train_small.py: the optimizer's
              step returns at once, so AdamW's momentum does not move the weights on a zero gradient

With gradient accumulation (an optimizer step over several micro-batches), step 4 needs the
entropies of the whole optimizer batch before the first backward: a no-grad forward of the kept
completions of that step runs first (pass 1), the loss forward follows per micro-batch (pass 2),
as in train_full.py. Without accumulation, one forward does both. Only the work a step needs:
pass 1 runs for the methods that select tokens only (d2s, d3s, d3s-i); the others (K = 1: every
token of the kept rollouts) skip it and gather nothing but the normalizer. Their old log-probs are
TRL's: the loss forward's own, detached, unless TRL computed them (num_iterations > 1,
steps_per_generation > gradient_accumulation_steps, vLLM importance sampling). Their entropy is a
metric only; TRL's fused LM head computes it in the same pass over the logit tiles as the
log-probs, a small cost that TRL's own trainer pays as well.

TRL options this trainer rejects, with an error naming the field, because they change the
objective that d3s.policy_loss computes: loss_type other than "dapo" (token-mean) or "grpo"
(seq-mean-token-mean), scale_rewards="batch", multi_objective_aggregation="normalize_then_sum",
top_entropy_quantile < 1, off_policy_mask_threshold, delta, use_bias_correction_kl with beta > 0, the entropy
bonus, token-level vLLM importance sampling, and multimodal inputs. The sequence-level vLLM
importance-sampling correction (TRL's default mode) scales each rollout's advantage by its ratio,
which is the same loss as TRL's. GSPO is importance_sampling_level="sequence", as in TRL.

Not saved by D3S: TRL's no-grad forwards over all rollouts before selection (the reference
model when beta > 0; old log-probs with vLLM's importance sampling, num_iterations > 1, or
steps_per_generation > gradient_accumulation_steps) run before the rewards exist, so they cover
every rollout. Set vllm_importance_sampling_correction=False to skip the one vLLM adds.

This file overrides GRPOTrainer internals (_calculate_rewards, _generate_and_score_completions,
_prepare_inputs, _compute_loss) and calls _get_per_token_logps_and_entropies; it is tested with
the TRL versions in SUPPORTED_TRL and refuses others (D3S_TRL_ALLOW_UNTESTED=1 only warns).
"""

import os
import sys
import types
import warnings
from dataclasses import dataclass, field

import torch

try:
    import d3s
    from support import methods
except ImportError:  # run from elsewhere: d3s.py lives in the repository root, one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import d3s
    from support import methods

import trl
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer

METRICS = (
    "n_keep",
    "k_frac",
    "kept_samples",
    "sur",
    "kept_adv_var",
    "kept_tokens",
    "fwd_tokens",
    "k_real",
)  # as the rungs name them
SUPPORTED_TRL = ">=1.16.0,<1.17"  # tested: 1.16.0 (requirements/trl.txt pins the same range)
OVERRIDDEN = (
    "_calculate_rewards",
    "_generate_and_score_completions",
    "_prepare_inputs",
    "_compute_loss",
    "_get_per_token_logps_and_entropies",
)
TRL_ADV_EPS = 1e-4  # TRL divides by (std + 1e-4); d3s.group_advantages takes eps, so the advantages are TRL's
LOSS_AGG = {"dapo": "token-mean", "grpo": "seq-mean-token-mean"}  # TRL loss_type -> d3s.policy_loss agg
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "token_type_ids", "mm_token_type_ids")


def check_trl_version(version=None):
    """Raise RuntimeError unless TRL's version is one this file was tested with (SUPPORTED_TRL)."""
    version = version or trl.__version__
    missing = [name for name in OVERRIDDEN if not hasattr(GRPOTrainer, name)]
    if Version(version) in SpecifierSet(SUPPORTED_TRL) and not missing:
        return
    msg = (
        f"integrations/trl.py supports trl{SUPPORTED_TRL} (tested with 1.16.0), found trl {version}"
        + (f" without GRPOTrainer.{', '.join(missing)}" if missing else "")
        + ": it overrides GRPOTrainer internals that change between TRL releases. "
        "Install a supported TRL with `pip install -r requirements/trl.txt`, "
        "or set D3S_TRL_ALLOW_UNTESTED=1 to try this version anyway."
    )
    if os.environ.get("D3S_TRL_ALLOW_UNTESTED") == "1" and not missing:
        warnings.warn(msg, stacklevel=3)
        return
    raise RuntimeError(msg)


# ---------------------------------------------------------------------------------------------
# Config: GRPOConfig plus the D3S fields
# ---------------------------------------------------------------------------------------------
@dataclass
class D3SGRPOConfig(GRPOConfig):
    """GRPOConfig plus D3S's fields. The defaults are a summary's schedule scaled to num_generations.

    d3s_method   a row of methods.LADDER: grpo, d1s, d1s-cross, d2s, d3s, d3s-i, pods, random, dapo-filter(-k)
    n_init/n_final   rollouts kept per prompt at the first/last step (default G/4 -> G: the
                 a summary's 8 -> 32 of G = 32, G inferred); k_init/k_final the fraction of tokens kept (5% -> 20%)
    static_n/static_k   N and K of the static rows (d1s, d1s-cross, d2s, pods); default the midpoint
    token_scope  "batch": one top K over the optimizer batch of all processes; "sequence": per response
    min_tokens_per_seq   1: every kept response keeps at least its best token; 0: plain top K
    normalize_by "selected": the loss divides by the selected tokens; "all": by every response
                 token of the kept rollouts (1/K smaller gradients)
    """

    d3s_method: str = field(default="d3s", metadata={"help": "a row of methods.LADDER: " + ", ".join(methods.NAMES)})
    n_init: int | None = field(
        default=None,
        metadata={"help": "N at step 0: rollouts kept per prompt (default num_generations // 4; a summary: 8 of 32)"},
    )
    n_final: int | None = field(
        default=None, metadata={"help": "N at max_steps (default num_generations; a summary: 32 of 32)"}
    )
    k_init: float = field(default=0.05, metadata={"help": "K at step 0: fraction of tokens kept (a summary: 0.05)"})
    k_final: float = field(default=0.20, metadata={"help": "K at max_steps (a summary: 0.20)"})
    static_n: int | None = field(
        default=None,
        metadata={"help": "N of the static rows d1s, d1s-cross, d2s, pods (default: the schedule's midpoint) (choice)"},
    )
    static_k: float | None = field(
        default=None, metadata={"help": "K of d2s (default: the schedule's midpoint) (choice)"}
    )
    token_scope: str = field(
        default="batch",
        metadata={
            "help": "top K over the optimizer batch of all processes (batch) or within each response (sequence) (choice)"
        },
    )
    min_tokens_per_seq: int = field(
        default=0, metadata={"help": "1: every kept response keeps its best token; 0: a plain top K (choice)"}
    )
    normalize_by: str = field(
        default="selected",
        metadata={
            "help": "loss normalizer: selected tokens (selected) or all response tokens of the kept rollouts (all) (choice)"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        G = self.num_generations
        if self.n_init is None:
            self.n_init = max(1, G // 4)
        if self.n_final is None:
            self.n_final = G
        check_d3s_config(self)


def check_d3s_config(args):
    """Raise ValueError naming the field, its value and the fix, before any model is loaded."""

    def require(ok, name, value, fix):
        if not ok:
            raise ValueError(f"D3SGRPOConfig.{name}={value!r}: {fix}")

    G = args.num_generations
    require(
        args.d3s_method in methods.LADDER,
        "d3s_method",
        args.d3s_method,
        f"choose one of {', '.join(methods.NAMES)}",
    )
    for name in ("n_init", "n_final") + (("static_n",) if args.static_n is not None else ()):
        value = getattr(args, name)
        require(
            isinstance(value, int) and 1 <= value <= G,
            name,
            value,
            f"must be an int in [1, num_generations={G}] (N counts rollouts kept per prompt); "
            f"lower {name} or raise num_generations",
        )
    for name in ("k_init", "k_final") + (("static_k",) if args.static_k is not None else ()):
        value = getattr(args, name)
        require(
            isinstance(value, (int, float)) and 0 < value <= 1,
            name,
            value,
            "must be in (0, 1] (fraction of tokens kept)",
        )
    require(args.token_scope in ("batch", "sequence"), "token_scope", args.token_scope, "choose 'batch' or 'sequence'")
    require(args.min_tokens_per_seq in (0, 1), "min_tokens_per_seq", args.min_tokens_per_seq, "choose 0 or 1")
    require(args.normalize_by in ("selected", "all"), "normalize_by", args.normalize_by, "choose 'selected' or 'all'")
    require(
        args.normalize_by == "selected" or args.loss_type == "dapo",
        "normalize_by",
        args.normalize_by,
        "'all' applies to the token mean (loss_type='dapo'); loss_type='grpo' divides by the responses",
    )
    # TRL options that change the objective d3s.policy_loss computes
    require(
        args.loss_type in LOSS_AGG,
        "loss_type",
        args.loss_type,
        "D3S supports 'dapo' (token mean over the batch, TRL's default) and 'grpo' (mean per response, then mean)",
    )
    require(
        args.scale_rewards in ("group", "none"),
        "scale_rewards",
        args.scale_rewards,
        "D3S selects within groups: use 'group' (GRPO) or 'none' (Dr. GRPO)",
    )
    require(
        args.multi_objective_aggregation == "sum_then_normalize",
        "multi_objective_aggregation",
        args.multi_objective_aggregation,
        "D3S ranks rollouts by one reward per rollout: use 'sum_then_normalize'",
    )
    require(
        args.top_entropy_quantile >= 1.0,
        "top_entropy_quantile",
        args.top_entropy_quantile,
        "D3S selects tokens itself (k_init/k_final): leave it at 1.0",
    )
    require(
        args.off_policy_mask_threshold is None,
        "off_policy_mask_threshold",
        args.off_policy_mask_threshold,
        "not supported with D3S: leave it None",
    )
    require(args.delta is None, "delta", args.delta, "two-sided clipping is not supported with D3S: leave it None")
    require(
        args.beta == 0.0 or not args.use_bias_correction_kl,
        "use_bias_correction_kl",
        args.use_bias_correction_kl,
        f"with beta={args.beta}, D3S adds d3s.policy_loss's k3 KL without TRL's importance weight: set it False",
    )
    require(
        args.entropy_coef == 0.0 and not args.use_adaptive_entropy,
        "entropy_coef",
        (args.entropy_coef, args.use_adaptive_entropy),
        "the entropy bonus is not supported with D3S: set entropy_coef=0 and use_adaptive_entropy=False",
    )
    require(
        not (
            args.use_vllm
            and args.vllm_importance_sampling_correction
            and not args.vllm_importance_sampling_mode.startswith("sequence")
        ),
        "vllm_importance_sampling_mode",
        args.vllm_importance_sampling_mode,
        "D3S applies vLLM importance sampling per rollout: use 'sequence_mask' (TRL's default) or "
        "'sequence_truncate', or set vllm_importance_sampling_correction=False",
    )
    gas, spg = args.gradient_accumulation_steps, args.steps_per_generation
    require(
        gas == 1 or spg % gas == 0,
        "steps_per_generation",
        spg,
        f"must be a multiple of gradient_accumulation_steps={gas}, so that an optimizer step's micro-batches "
        "come from one generation batch (token selection runs over the optimizer batch)",
    )
    # d3s's own checks of the budget at the first, middle and last step
    for step in (0, 1, 2):
        try:
            d3s.method_budget(
                methods.LADDER[args.d3s_method],
                step=step,
                total_steps=2,
                group_size=G,
                n_init=args.n_init,
                n_final=args.n_final,
                k_init=args.k_init,
                k_final=args.k_final,
                static_n=args.static_n,
                static_k=args.static_k,
            )
        except ValueError as e:
            raise ValueError(f"D3SGRPOConfig: {e}") from None


# ---------------------------------------------------------------------------------------------
# Trainer: GRPOTrainer with D3S's selection and loss
# ---------------------------------------------------------------------------------------------
class D3SGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that trains on D3S's rollouts and tokens (see this module's docstring).

    Logged with TRL's metrics (per optimizer step, averaged over logging_steps):
      n_keep, k_frac            this step's budget (rollouts per prompt, fraction of tokens)
      kept_samples                 rollouts of the generation batch trained on (all processes)
      sur        share of the kept rollouts with A != 0 (d3s.usefulness_rate)
      kept_adv_var                  unbiased Var(A) of the kept rollouts (d3s.kept_variance)
      kept_tokens, k_real   selected tokens of the optimizer batch, and their share of
                                        the response tokens of the kept rollouts
      fwd_tokens              response tokens forwarded with grad (the kept rollouts')
    """

    def __init__(self, *args, **kwargs):
        check_trl_version()
        import inspect

        config = inspect.signature(GRPOTrainer.__init__).bind_partial(None, *args, **kwargs).arguments.get("args")
        if not isinstance(config, D3SGRPOConfig):
            raise TypeError(
                f"D3SGRPOTrainer(args=...): got {type(config).__name__}; pass a D3SGRPOConfig "
                "(GRPOConfig plus d3s_method, n_init, n_final, k_init, k_final, ...)"
            )
        self._d3s_nothing_selected = False  # set per optimizer step by _normalizer, read by the optimizer's step
        super().__init__(*args, **kwargs)
        self._d3s_rewards_per_func = None

    # -- 1 rewards: TRL's, kept for selection ---------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._d3s_rewards_per_func = rewards_per_func  # [B_global, n_funcs], gathered from every process
        return rewards_per_func

    def _global_rewards(self):
        """One reward per rollout of the global batch, as TRL sums them: sum_f w_f * R_f (NaN -> 0)."""
        per_func = self._d3s_rewards_per_func
        unscorable = torch.isnan(per_func).all(dim=1)
        if unscorable.any():
            raise ValueError(
                f"reward_funcs: every reward function returned None for {int(unscorable.sum())} "
                "completion(s); D3S ranks every rollout by its reward, so return a number for each"
            )
        return (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1).float().cpu()

    # -- 2 samples: one choice on the global batch ----------------------------------------------
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        training = self.model.training
        G = self.num_generations if training else self.num_generations_eval
        rewards = self._global_rewards().view(-1, G)  # [P, G] of all processes, in process order
        args = self.args
        if training:
            method, step = args.d3s_method, self.state.global_step
            total = max(int(self.state.max_steps or args.max_steps), 1)
            n_keep, k_frac = d3s.method_budget(
                methods.LADDER[method],
                step=min(step, total),
                total_steps=total,
                group_size=G,
                n_init=args.n_init,
                n_final=args.n_final,
                k_init=args.k_init,
                k_final=args.k_final,
                static_n=args.static_n,
                static_k=args.static_k,
            )
        else:  # evaluation loss: every rollout, every token
            method, step, n_keep, k_frac = "grpo", 0, G, 1.0
        generator = torch.Generator().manual_seed(args.seed * 7919 + step)  # "random": one draw for all processes
        keep, adv = d3s.select_samples(
            rewards,
            n_keep,
            methods.LADDER[method].samples,
            scale=self.scale_rewards == "group",
            eps=TRL_ADV_EPS,
            generator=generator,
        )  # [P, G] each
        B = output["completion_ids"].shape[0]  # this process's rows: [i * B, (i + 1) * B) of the global batch
        mine = slice(self.accelerator.process_index * B, (self.accelerator.process_index + 1) * B)
        device = output["advantages"].device
        output["advantages"] = adv.view(-1)[mine].to(device)  # 0 where not kept; PODS: recomputed on the kept
        output["d3s_keep"] = keep.view(-1)[mine].to(device)
        output["d3s_k_frac"] = torch.tensor(float(k_frac), dtype=torch.float64)  # 0-dim: TRL's split passes it on
        if training:
            metrics = self._metrics["train"]
            metrics["n_keep"].append(float(n_keep))
            metrics["k_frac"].append(float(k_frac))
            metrics["kept_samples"].append(float(keep.sum()))
            metrics["sur"].append(d3s.usefulness_rate(adv, keep))
            metrics["kept_adv_var"].append(d3s.kept_variance(adv, keep))
        return output

    # -- 3 forward: the kept rows only ----------------------------------------------------------
    def _kept_rows(self, inputs, rows):
        """input_ids, attention_mask, loss mask [n, T] and T for `rows` of a micro-batch, with the
        completion columns that no kept row uses cut off (right padding; earlier positions and
        the left-padded prompts are untouched)."""
        for key in MULTIMODAL_KEYS:
            if inputs.get(key) is not None:
                raise ValueError(f"D3SGRPOTrainer: inputs carry {key!r}; D3S inside TRL supports text-only prompts")
        completion_mask = inputs["completion_mask"][rows]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"][rows]
        used = completion_mask.any(0).nonzero()
        T = int(used[-1]) + 1 if used.numel() else 1
        input_ids = torch.cat([inputs["prompt_ids"][rows], inputs["completion_ids"][rows, :T]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"][rows], completion_mask[:, :T]], dim=1)
        return input_ids, attention_mask, loss_mask[:, :T], T

    # -- 4 tokens: one top K over the optimizer batch of all processes --------------------------
    def _gather_rows(self, x):
        """[n_i, T_i] from every process -> ([sum n_i, max T_i], [n_i]), in process order."""
        if self.accelerator.num_processes == 1:
            return x, [x.shape[0]]
        shapes = self.accelerator.gather(torch.tensor([list(x.shape)], device=x.device)).view(-1, 2).tolist()
        rows, cols = max(max(n for n, _ in shapes), 1), max(t for _, t in shapes)
        padded = x.new_zeros(rows, cols)
        padded[: x.shape[0], : x.shape[1]] = x
        everything = self.accelerator.gather(padded)  # [processes * rows, cols]
        return torch.cat([everything[i * rows : i * rows + n] for i, (n, _) in enumerate(shapes)]), [
            n for n, _ in shapes
        ]

    def _select_tokens(self, scores, mask, k_frac):
        """d3s.select_tokens on the [n, T] scores of ALL processes at once (on CPU, so every
        process makes the identical choice); returns this process's rows of the kept mask."""
        all_scores, counts = self._gather_rows(scores.float())
        all_mask, _ = self._gather_rows(mask.float())
        keep = d3s.select_tokens(
            all_scores.cpu(),
            all_mask.cpu() > 0,
            k_frac,
            scope=self.args.token_scope,
            min_per_seq=self.args.min_tokens_per_seq,
        )
        first = sum(counts[: self.accelerator.process_index])
        return keep[first : first + scores.shape[0], : scores.shape[1]].to(scores.device)

    def _normalizer(self, token_keep, mask):
        """The loss normalizer of the optimizer batch over all processes (as d3s.policy_loss's
        docstring asks), and the global counts of selected and of response tokens."""
        if LOSS_AGG[self.loss_type] == "seq-mean-token-mean":
            local = token_keep.any(-1).sum()  # responses with a selected token
        else:
            local = (token_keep if self.args.normalize_by == "selected" else mask.bool()).sum()
        totals = self.accelerator.reduce(torch.stack([local, token_keep.sum(), mask.bool().sum()]).float(), "sum")
        if self.model.training:  # the same global count on every process: all step, or all skip (create_optimizer)
            self._d3s_nothing_selected = bool(totals[1] == 0)
        return max(float(totals[0]), 1.0), float(totals[1]), float(totals[2])

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        gas = self.args.gradient_accumulation_steps
        if self.model.training and gas > 1 and self._step % gas == 0:  # first micro-batch of an optimizer step
            spg = self.args.steps_per_generation
            self._select_tokens_for_step([self._buffered_inputs[(self._step + i) % spg] for i in range(gas)])
        return inputs

    @torch.no_grad()
    def _select_tokens_for_step(self, micro_batches):
        """Pass 1 (gradient accumulation only): entropies of the kept rows of every micro-batch of
        this optimizer step, one d3s.select_tokens over them and all processes, one normalizer.
        Writes d3s_token_keep [B, T] and d3s_normalizer into each micro-batch."""
        from trl.models.utils import disable_gradient_checkpointing

        k_frac = float(micro_batches[0]["d3s_k_frac"])
        parts = []  # (micro-batch, rows, scores [n, T], mask [n, T])
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for mb in micro_batches:
                rows = mb["d3s_keep"].nonzero().view(-1)
                input_ids, attention_mask, mask, T = self._kept_rows(mb, rows)
                if rows.numel() and k_frac < 1.0:
                    _, entropy, _ = self._get_per_token_logps_and_entropies(
                        self.model,
                        input_ids,
                        attention_mask,
                        T,
                        batch_size=self.args.per_device_train_batch_size,
                        compute_entropy=True,
                    )
                    scores = d3s.token_scores(mb["advantages"][rows], entropy)  # |A_i| * H_{i,t}
                else:
                    scores = torch.zeros(mask.shape, device=mask.device)
                parts.append((mb, rows, scores, mask))
        width = max(s.shape[1] for _, _, s, _ in parts)
        pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))
        scores = torch.cat([pad(s) for _, _, s, _ in parts])
        mask = torch.cat([pad(m) for _, _, _, m in parts]).bool()
        token_keep = self._select_tokens(scores, mask, k_frac) if k_frac < 1.0 else mask
        normalizer, n_selected, n_tokens = self._normalizer(token_keep, mask)
        start = 0
        for mb, rows, s, _ in parts:
            full = torch.zeros(mb["completion_ids"].shape, dtype=torch.bool, device=mb["completion_ids"].device)
            full[rows, : s.shape[1]] = token_keep[start : start + len(rows), : s.shape[1]]
            mb["d3s_token_keep"] = full
            mb["d3s_normalizer"] = torch.tensor(normalizer)
            start += len(rows)
        self._log_token_counts(n_selected, n_tokens)

    def _log_token_counts(self, n_selected, n_tokens):
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["kept_tokens"].append(n_selected)
        metrics["fwd_tokens"].append(n_tokens)
        metrics["k_real"].append(n_selected / max(n_tokens, 1.0))

    # -- 5 loss: d3s.policy_loss on the selected tokens ----------------------------------------
    def _compute_loss(self, model, inputs):
        rows = inputs["d3s_keep"].nonzero().view(-1)  # the kept rollouts of this micro-batch
        # Nothing kept here: one row goes through the model with a zero loss, so that this process
        # still joins DDP's gradient all-reduce and the gathers below.
        dummy = rows.numel() == 0
        input_ids, attention_mask, mask, T = self._kept_rows(inputs, rows if not dummy else rows.new_zeros(1))
        logps, entropy, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, T, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled
        )
        if dummy:
            mask = mask[:0]
        adv = inputs["advantages"][rows]  # [n]
        entropy = entropy.detach()[: len(rows)]
        k_frac = float(inputs["d3s_k_frac"])

        if "d3s_token_keep" in inputs:  # chosen in pass 1 for the whole optimizer step
            token_keep = inputs["d3s_token_keep"][rows, :T] & mask.bool()
            normalizer = float(inputs["d3s_normalizer"])
        else:  # one micro-batch per optimizer step: select from this forward's entropies
            scores = d3s.token_scores(adv, entropy)  # |A_i| * H_{i,t}
            token_keep = self._select_tokens(scores, mask, k_frac) if k_frac < 1.0 else mask.bool()
            normalizer, n_selected, n_tokens = self._normalizer(token_keep, mask)
            self._log_token_counts(n_selected, n_tokens)

        if dummy:
            loss = logps.sum() * 0.0
            stats = {"clip_frac": 0.0, "tokens": 0.0}
        else:
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old[rows, :T]
            ref = inputs["ref_per_token_logps"][rows, :T] if self.beta != 0.0 else None
            loss_adv = adv
            if self.use_vllm and self.vllm_importance_sampling_correction:  # sequence-level ratio (B, 1), >= 0:
                loss_adv = adv * inputs["importance_sampling_ratio"][rows].view(-1)  # r * min(wA, cA) = min(w rA, c rA)
            loss, stats = d3s.policy_loss(
                logps,
                old,
                loss_adv,
                token_keep,
                kind="gspo" if self.importance_sampling_level == "sequence" else "grpo",
                clip_low=self.epsilon_low,
                clip_high=self.epsilon_high,
                ref_logp=ref,
                beta=self.beta,
                normalizer=normalizer / self.accelerator.num_processes,  # DDP averages the processes' gradients
                agg=LOSS_AGG[self.loss_type],
            )
        if self.aux_loss_enabled:  # MoE load balancing, as TRL adds it
            gas = self.current_gradient_accumulation_steps if self.model.training else 1
            loss = loss + self.router_aux_loss_coef * aux_loss / gas

        # TRL's metrics, over the kept rollouts (entropy) and the selected tokens (clipping)
        metrics = self._metrics["train" if self.model.training else "eval"]
        sums = torch.tensor(
            [
                float((entropy.float() * mask).sum()),
                float(mask.sum()),
                stats["clip_frac"] * stats["tokens"],
                stats["tokens"],
            ],
            device=logps.device,
        )
        sums = self.accelerator.reduce(sums, "sum")
        metrics["entropy"].append(float(sums[0] / sums[1].clamp(min=1)))
        metrics["clip_ratio/region_mean"].append(float(sums[2] / sums[3].clamp(min=1)))
        if self.beta != 0.0 and not dummy:
            metrics["kl"].append(stats["kl"])
        return loss

    # -- 6 step: none when no process selected a token ------------------------------------------
    def create_optimizer(self, model=None):
        """TRL's optimizer, whose step returns without stepping when no token of the optimizer step
        was selected on any process (_normalizer's global count; called once per optimizer step).
        The gradient is then exactly 0, but AdamW would still move the weights by its momentum
        (and weight decay); train_full.py and train_small.py make no step there either. The loop
        goes on as usual: zero_grad, the lr schedule and global_step advance (the step counts)."""
        optimizer = super().create_optimizer(model)
        step = optimizer.step

        def skip_if_nothing_selected(opt, *args, **kwargs):
            skip, self._d3s_nothing_selected = self._d3s_nothing_selected, False
            return None if skip else step(*args, **kwargs)

        # a bound method, as torch's LR scheduler expects when it wraps step (it reads __func__)
        optimizer.step = types.MethodType(skip_if_nothing_selected, optimizer)
        return optimizer
