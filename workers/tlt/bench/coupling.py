"""How often the drafter's draw equals the target's at the first draft position, by coupling rule:
the headroom a better coupling would buy SD under sampling. The LAST stdout line is one JSON object.

    python -m workers.tlt.bench coupling [--preset smollm2-mathmix-cpu] [--prompts 32] [--temperatures 0.7 1.0]
                                         [--held-out-tokens 1024]                 # answers past the warm-up's cap
                                         [--draft-temperatures 0.5 0.6]           # a sharper drafter's proposals
                                         [--set drafter.warmup_prompts=2048 ...]   # another recipe
                                         [--spot-lrs 3e-4 5e-5 [--spot-steps 6]]   # spot training's effect
    python -m workers.tlt.bench coupling --recipes drafter.token_loss_weight=1.0 drafter.unroll=2 \
                                         [--recipe-steps 400] [--holdout 96]       # warm-up recipes compared

The preset's policy answers held-out prompts of its task (as the drafter warm-up does, same cap);
at every response position the target's distribution p and the warmed-up drafter's q (the product's
recipe, cached; its reduced draft vocabulary) are compared, at each temperature, under

    race               the product's rule: the keyed race of each (sampling.draw: the likeliest
                       tokens one by one with shared noise, the rest as one block; SD token for token
                       identical to plain sampling)
    keyed_inverse_cdf  the rule until then: F^{-1}(u) of each in token-id order at one shared u
    keyed_argmax_first the same with each distribution's most likely token first (tried: lower)
    gumbel             argmax(log p + g) = argmax(log q + g) at shared Gumbel noise g over the whole
                       vocabulary (what the race approximates with a block for the unlikely tokens)
    maximal            sum min(p, q): standard speculative sampling's rejection rule (the most any
                       coupling gives; lossless in distribution only, not token for token)
    greedy_draft       p(argmax q): a drafter that proposes its argmax, accepted by the keyed rule
    keyed_or_runner_up the target's draw is the drafter's keyed draw or its runner-up, the neighbour
                       across the nearer edge of its CDF interval (a tree's second child under sampling)
    keyed_or_likeliest the same with the drafter's likeliest other token as the second candidate
    race_or_likeliest  the race's draws, the drafter's likeliest other token second
    race_or_runner_up  the race's draws, the drafter's runner-up in its race second (draw's `places`)

`p_max` is E[max p], and `race_block_mass` the mass of p outside its RACE_TOKENS likeliest tokens
(how often the race's block of unlikely tokens wins). Exact for the inverse-CDF rules and `maximal`; Monte Carlo (`--gumbel-draws`
uniforms or noises per position) for the race, gumbel and the pairs. `runner_up_by_gap` splits the draws at
the preset's temperature by how far u sits from the keyed draw's nearer interval edge, as a fraction
of the mass: how often the target drew the keyed draw, the runner-up and the likeliest other token.
"Keyed agreement" below is the product's rule, the race (`keyed_agreement`: KEYED_DRAWS races per
position, the same keys for every drafter it scores); figures measured before the race (README)
are the inverse-CDF rule's. `--draft-temperatures` scores the drafter's keyed draws from its q at other temperatures (the target
at the preset's) at draft steps 1 and 2: any proposal is verified against the target's own draw.
`by_position` splits the keyed agreement at the preset's temperature by response position; with
`--held-out-tokens` (the rollout's 1024, say) the held-out answers run past the warm-up's cap, where
the long tail spends most of its decoding.

`--spot-lrs` also measures what spot training does to the warmed-up drafter: the policy answers
`--spot-steps` fresh batches of a step's prompts (`task.prompts_per_step`), and a copy of the
drafter trains on each in turn as a worker does (one AdamW kept across them, resumed from the
warm-up's, the preset's `batch_tokens`, `drafter.spot_max_epochs` passes, at least one), at each
learning rate; `spot` holds the held-out keyed agreement at the preset's temperature after each
batch ("before": none), and under "fresh_adamw" the same from fresh AdamW moments (how workers
trained before they resumed the warm-up's).

`--recipes` compares warm-up recipes instead, cheaply: each (comma-separated `--set` overrides of
the preset, beside the preset's own recipe) trains a fresh drafter for `--recipe-steps` (or its own
`drafter.warmup_steps`: a cheaper recipe may train longer, to compare at equal time) on the
cached warm-up answers but the last `--holdout`, which score it: keyed agreement at the preset's
temperature at draft step 1 (the target's own state in) and step 2 (the drafter's predicted state
in, as when drafting a chain; given step 1 agreed), and `chain_tokens`, the tokens a verify pass of
a `depth`-deep chain would emit if every later position agreed as often as step 2. `--recipes`
with no recipe scores the preset's alone (at another `--recipe-steps`, say).
Benchmarks measure; tests check correctness, never timings.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

import torch
from torch import Tensor

from ..rollout.sampling import RACE_TOKENS, draw, sample


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-mathmix-cpu", help="policy, task, drafter recipe and draft vocabulary")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts answered by the policy")
    p.add_argument("--temperatures", type=float, nargs="+", default=None,
                   help="sampling temperatures compared (default: the preset's, and 1.0)")
    p.add_argument("--gumbel-draws", type=int, default=16, help="Monte Carlo draws of the Gumbel noise per position")
    p.add_argument("--spot-lrs", type=float, nargs="*", default=[],
                   help="also: held-out keyed agreement after spot training at these learning rates (module doc)")
    p.add_argument("--spot-steps", type=int, default=6, help="fresh batches of answers spot training goes through")
    p.add_argument("--recipes", nargs="*", default=None, metavar="SECTION.FIELD=VALUE[,...]",
                   help="instead: warm-up recipes compared with the preset's on held-out warm-up answers (module doc; "
                        "none given: the preset's alone)")
    p.add_argument("--recipe-steps", type=int, default=400,
                   help="warm-up steps of each compared recipe (a recipe may set its own drafter.warmup_steps)")
    p.add_argument("--holdout", type=int, default=96, help="warm-up answers kept out of training to score recipes")
    p.add_argument("--draft-temperatures", type=float, nargs="*", default=[],
                   help="also: held-out keyed agreement at draft steps 1 and 2 with the drafter's q at these "
                        "temperatures, the target's at the preset's")
    p.add_argument("--held-out-tokens", type=int, default=None,
                   help="length cap of the held-out answers (default: the warm-up's cap; the rollout's, say, to "
                        "score the long tail's late positions, which `by_position` splits out)")


def _intervals(p: Tensor, order: Tensor) -> tuple[Tensor, Tensor]:
    """Each token's [lo, hi) CDF interval when p's mass is laid out in `order` (a permutation per row)."""
    po = p.gather(1, order)
    hi = po.cumsum(1)
    return torch.empty_like(p).scatter_(1, order, hi - po), torch.empty_like(p).scatter_(1, order, hi)


def inverse_cdf_agreement(p: Tensor, q: Tensor, order_p: Tensor, order_q: Tensor) -> Tensor:
    """P(F_p^{-1}(u) = F_q^{-1}(u)) for u ~ U[0, 1), per row: the overlap of each token's intervals."""
    lp, hp = _intervals(p, order_p)
    lq, hq = _intervals(q, order_q)
    return (torch.minimum(hp, hq) - torch.maximum(lp, lq)).clamp(min=0).sum(1)


def _argmax_first(x: Tensor) -> Tensor:
    V = x.shape[1]
    top = x.argmax(1, keepdim=True)
    ids = torch.arange(V).expand_as(x)
    return torch.cat([top, ids[ids != top].view(x.shape[0], V - 1)], 1)


def _keys(n: int, draws: int, gen: torch.Generator) -> Tensor:
    """[draws, n] random sample keys: one race per position and draw."""
    return torch.randint(-(1 << 63), (1 << 63) - 1, (draws, n), generator=gen)


def race_agreement(p: Tensor, q: Tensor, keys: Tensor) -> Tensor:
    """How often the product's keyed race (sampling.draw) draws the same token from p and q [N, V],
    per row, over one race per key in keys [draws, N]."""
    pos = torch.zeros(p.shape[0], dtype=torch.long)
    return sum((draw(p, k, pos) == draw(q, k, pos)).double() for k in keys) / keys.shape[0]


def agreements(p: Tensor, q: Tensor, gumbel_draws: int, gen: torch.Generator) -> dict[str, Tensor]:
    """Per-row figures (module doc) for target distributions p and drafter distributions q [N, V] (float64)."""
    ids = torch.arange(p.shape[1]).expand_as(p)
    lp, lq = p.clamp_min(1e-300).log(), q.clamp_min(1e-300).log()
    gumbel = torch.zeros(p.shape[0], dtype=torch.float64)
    for _ in range(gumbel_draws):
        g = -torch.log(-torch.log(torch.rand(p.shape, generator=gen, dtype=torch.float64).clamp(1e-300, 1 - 1e-16)))
        gumbel += ((lp + g).argmax(1) == (lq + g).argmax(1)).double() / gumbel_draws
    return {"race": race_agreement(p, q, _keys(p.shape[0], gumbel_draws, gen)),
            "keyed_inverse_cdf": inverse_cdf_agreement(p, q, ids, ids),
            "keyed_argmax_first": inverse_cdf_agreement(p, q, _argmax_first(p), _argmax_first(q)),
            "gumbel": gumbel, "maximal": torch.minimum(p, q).sum(1),
            "greedy_draft": p.gather(1, q.argmax(1, keepdim=True))[:, 0], "p_max": p.max(1).values,
            "race_block_mass": 1.0 - p.topk(min(RACE_TOKENS, p.shape[1]), 1).values.sum(1) / p.sum(1)}


def runner_up(probs: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The keyed draw of probs [..., V] at u [...] and the draw's runner-up: the token with mass
    across the nearer edge of the draw's CDF interval. Returns (token, runner_up, gap), gap the
    distance from u to that edge as a fraction of the mass.

    Were the drafter's CDF the target's shifted by a little, the target's keyed draw would land on
    the drafter's own draw or, where u sits near an interval edge, on the neighbour across it: a
    tree's second candidate under keyed sampling. Measured, it is not (module doc).
    """
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:]
    x = u.double()[..., None] * total
    tok = torch.searchsorted(cdf, x, right=True).clamp_(max=probs.shape[-1] - 1)
    hi = cdf.gather(-1, tok)
    lo = torch.where(tok > 0, cdf.gather(-1, (tok - 1).clamp(min=0)), torch.zeros_like(hi))
    below = torch.searchsorted(cdf, lo, right=False)  # the last token with mass before the draw
    above = torch.searchsorted(cdf, hi, right=True).clamp_(max=probs.shape[-1] - 1)  # the first one after it
    has_below, has_above = lo > 0, hi < total
    down = has_below & ((x - lo < hi - x) | ~has_above)
    alt = torch.where(down, below, torch.where(has_above, above, tok))
    gap = torch.where(down, x - lo, torch.where(has_above, hi - x, total)) / total
    return tok[..., 0], alt[..., 0], gap[..., 0].float()


GAP_EDGES = (0.0, 0.01, 0.03, 0.1, 0.3)  # runner_up_by_gap's buckets of the draw's distance to its interval's edge


def second_candidates(p: Tensor, q: Tensor, draws: int, gen: torch.Generator) -> tuple[dict[str, Tensor], Tensor]:
    """How often the target's keyed draw is one of two drafted candidates, per row (Monte Carlo over
    `draws` uniforms), for the second candidate a tree drafts under keyed sampling:

        keyed_or_runner_up  the drafter's keyed draw or its runner-up (runner_up, above)
        keyed_or_likeliest  the keyed draw or the drafter's likeliest other token (its log-prob
                            ranks the other children)

    and, per draw, [gap bucket, the target drew: the keyed draw, the runner-up, the likeliest other
    (when not the runner-up)] [draws * N, 4]
    (`runner_up_by_gap`: what a tree's scores should say about each candidate).
    """
    top2 = q.topk(2, 1).indices
    both = {k: torch.zeros(p.shape[0], dtype=torch.float64)
            for k in ("keyed_or_runner_up", "keyed_or_likeliest", "race_or_likeliest", "race_or_runner_up")}
    pos = torch.zeros(p.shape[0], dtype=torch.long)
    calib = []
    for keys in _keys(p.shape[0], draws, gen):
        u = torch.rand(p.shape[0], generator=gen, dtype=torch.float64)
        y = sample(p, u)
        tok, alt, gap = runner_up(q, u)
        likeliest = torch.where(top2[:, 0] == tok, top2[:, 1], top2[:, 0])
        both["keyed_or_runner_up"] += ((y == tok) | (y == alt)).double() / draws
        both["keyed_or_likeliest"] += ((y == tok) | (y == likeliest)).double() / draws
        raced, second = draw(q, keys, pos, places=2).unbind(-1)
        other = torch.where(top2[:, 0] == raced, top2[:, 1], top2[:, 0])
        y_race = draw(p, keys, pos)
        both["race_or_likeliest"] += ((y_race == raced) | (y_race == other)).double() / draws
        both["race_or_runner_up"] += ((y_race == raced) | (y_race == second)).double() / draws
        bucket = torch.bucketize(gap.double(), torch.tensor(GAP_EDGES, dtype=torch.float64), right=True) - 1
        calib.append(torch.stack([bucket.double(), (y == tok).double(), ((y == alt) & (alt != tok)).double(),
                                  ((y == likeliest) & (likeliest != alt)).double()], 1))
    return both, torch.cat(calib)


def _logits(policy, drafter, answers, ids: Tensor | None, step: int = 1):
    """Per answer: the target's logits and the drafter's (over its draft vocabulary `ids`) at draft
    step `step` (steps > 1 read the drafter's own predicted states) at the positions that predict
    response tokens, in response order (row k predicts response token k + 1, whatever the step)."""
    from ..learn.drafter_train import unrolled_predictions

    head = policy.lm_head.weight.detach().float()
    drafter.eval()
    with torch.no_grad():
        for toks, hid, plen in answers:
            h = hid.to(policy.dtype)[None]
            pred = unrolled_predictions(drafter, h, toks[None], step)[step - 1][0].float()  # [L-1, H] ~ h_{i+1}
            rows = slice(max(plen - 1, step - 1, 0), pred.shape[0])
            yield h[0, 1:][rows].float() @ head.T, pred[rows] @ (head if ids is None else head[ids]).T


def _distributions(logits_p: Tensor, logits_q: Tensor, ids: Tensor | None, temperature: float,
                   draft_temperature: float | None = None) -> tuple[Tensor, Tensor]:
    """p and q over the whole vocabulary (float64), q zero outside the draft vocabulary; q at
    draft_temperature where given (the drafter's proposal need not use the target's)."""
    from ..rollout.sampling import SamplingParams, process

    p = process(logits_p, SamplingParams(temperature=temperature)).double()
    q_sub = process(logits_q, SamplingParams(temperature=draft_temperature or temperature)).double()
    return p, (q_sub if ids is None else torch.zeros_like(p).index_copy_(1, ids, q_sub))


KEYED_DRAWS = 8  # races per position in keyed_agreement (the same keys for every drafter scored: paired)


def keyed_agreement(policy, drafter, answers, ids: Tensor | None, temperature: float, step: int = 1,
                    draft_temperature: float | None = None) -> float:
    """The product's rule only (cheaper): mean agreement of the keyed race over the answers' positions
    at draft step `step`, KEYED_DRAWS races per position with fixed keys, so two drafters scored on
    the same answers race with the same noise."""
    gen = torch.Generator().manual_seed(0)
    total, n = 0.0, 0
    for logits_p, logits_q in _logits(policy, drafter, answers, ids, step):
        p, q = _distributions(logits_p, logits_q, ids, temperature, draft_temperature)
        total += float(race_agreement(p, q, _keys(p.shape[0], KEYED_DRAWS, gen)).sum())
        n += p.shape[0]
    return total / max(n, 1)


def spot_curve(policy, drafter, cfg, batches, held_out, ids: Tensor | None, lr: float,
               optimizer: dict[str, Any] | None) -> list[float]:
    """Held-out keyed agreement after spot training a copy of `drafter` on each batch of answers in
    turn, as a worker trains (module doc), from the AdamW state `optimizer` (None: fresh moments)."""
    import copy

    from ..cluster.spot import step_budget
    from ..learn.buffer import DrafterBuffer
    from ..learn.drafter_train import DrafterTrainer

    dc = cfg.drafter.model_copy(update={"lr": lr})
    trainer = DrafterTrainer(copy.deepcopy(drafter), dc, seed=cfg.run.seed)
    if optimizer is not None:
        trainer.load_state_dict({"drafter": trainer.drafter.state_dict(), "optimizer": optimizer})
    curve = []
    for step, answers in enumerate(batches, start=1):
        buf = DrafterBuffer(max_tokens=10 ** 12)
        for toks, hid, plen in answers:
            buf.add(toks, hid, response_start=plen, step=step)
        trainer.train(buf, max(1, step_budget(buf.trainable_tokens, dc.batch_tokens, dc.spot_max_epochs or 1)))
        curve.append(round(keyed_agreement(policy, trainer.drafter, held_out, ids, cfg.rollout.temperature), 4))
    return curve


def gap_table(calib: Tensor) -> dict[str, dict[str, float]]:
    """second_candidates' per-draw rows -> per gap bucket: how often the target drew the keyed draw,
    the runner-up and the likeliest other token, and how many draws fell there."""
    lo, hi = GAP_EDGES, [*GAP_EDGES[1:], 1.0]
    out = {}
    for b, (a, z) in enumerate(zip(lo, hi)):
        rows = calib[calib[:, 0] == b]
        if len(rows):
            out[f"{a:g}-{z:g}"] = {"keyed": round(float(rows[:, 1].mean()), 4),
                                   "runner_up": round(float(rows[:, 2].mean()), 4),
                                   "likeliest": round(float(rows[:, 3].mean()), 4), "draws": len(rows)}
    return out


POSITION_EDGES = (0, 128, 384, 768)  # by_position's buckets (and the warm-up's cap), the same for every recipe


class PositionMeans:
    """Means of a per-position figure by response position, in buckets [edges[i], edges[i+1]) (the
    last one open): the warm-up's answers stop at its cap, the rollout's tail decodes far past it."""

    def __init__(self, edges: list[int]):
        self.edges = torch.tensor(edges)
        self.sums = torch.zeros(len(edges), dtype=torch.float64)
        self.counts = torch.zeros(len(edges), dtype=torch.float64)

    def add(self, values: Tensor) -> None:
        """One answer's figures, values[k] at response position k."""
        bucket = torch.bucketize(torch.arange(len(values)), self.edges, right=True) - 1
        self.sums.index_add_(0, bucket, values.double())
        self.counts.index_add_(0, bucket, torch.ones(len(values), dtype=torch.float64))

    def means(self) -> dict[str, tuple[float, int]]:
        """"lo-hi" (or "lo-" for the last) -> (mean, positions), for the buckets that got any."""
        lo, hi = self.edges.tolist(), [*self.edges.tolist()[1:], None]
        return {f"{a}-{b if b is not None else ''}": (round(float(s / c), 4), int(c))
                for a, b, s, c in zip(lo, hi, self.sums, self.counts) if c}


def chain_tokens(step1: float, step2: float, depth: int) -> float:
    """Expected tokens per verify pass of a `depth`-deep chain: the emitted token plus the accepted
    drafts, when position 1 agrees with probability step1 and each later one with step2."""
    return 1.0 + step1 * sum(step2 ** k for k in range(depth))


def recipe_scores(policy, answers, recipes: dict[str, Any], holdout: int, ids_size: int, temperature: float,
                  depth: int, eos_ids, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Each recipe (name -> DrafterSection) trained on all answers but the last `holdout`, scored on
    those (module doc); the draft vocabulary is the `ids_size` most frequent tokens of the training
    answers (0: all)."""
    from ..learn.drafter_warmup import fit_drafter
    from ..rollout.speculative import draft_vocab_ids

    if not 0 < holdout < len(answers):
        raise ValueError(f"--holdout must leave answers on both sides (1..{len(answers) - 1}), not {holdout}")
    train, held = answers[:-holdout], answers[-holdout:]
    out = {}
    for name, recipe in recipes.items():
        print(f"[bench coupling] recipe {name}: {recipe.warmup_steps} steps on {len(train)} answers", file=sys.stderr,
              flush=True)
        drafter, info = fit_drafter(policy, train, recipe, eos_ids=eos_ids, seed=seed)
        ids = draft_vocab_ids(drafter.token_counts, ids_size, eos_ids) if ids_size else None
        a1, a2 = (keyed_agreement(policy, drafter, held, ids, temperature, step) for step in (1, 2))
        out[name] = {"step1": round(a1, 4), "step2": round(a2, 4), "chain_tokens": round(chain_tokens(a1, a2, depth), 3),
                     "steps": info["steps"], "train_s": info["train_s"]}
    return out


# what decides the answers every recipe shares
FIXED_IN_RECIPES = {"drafter.warmup_prompts", "drafter.warmup_max_new_tokens", "drafter.warmup_continue"}


def recipe_sections(preset_name: str, sets: list[str], recipes: list[str], steps: int) -> dict[str, Any]:
    """name -> DrafterSection of the preset's recipe and each of `recipes` (comma-separated `--set`
    overrides on top of `sets`), each training `steps` steps unless it sets its own
    drafter.warmup_steps: a cheaper recipe may train longer, for a comparison at equal time."""
    from ..config import preset
    from .e2e import parse_overrides

    out = {"preset": preset(preset_name, parse_overrides(sets)).drafter.model_copy(update={"warmup_steps": steps})}
    for r in recipes:
        own = parse_overrides(r.split(","))
        fields = {f"{section}.{field}" for section, d in own.items() for field in d}
        if bad := sorted(f for f in fields if not f.startswith("drafter.") or f in FIXED_IN_RECIPES):
            raise SystemExit(f"--recipes {r!r}: {', '.join(bad)} cannot vary here: a recipe changes how the drafter "
                             "trains on the same answers (drafter.* but the answers' fields)")
        out[r] = preset(preset_name, parse_overrides([*sets, *r.split(",")])).drafter.model_copy(
            update={"warmup_steps": own.get("drafter", {}).get("warmup_steps", steps)})
    return out


def _preset_policy(args: argparse.Namespace):
    """The preset's config, policy folder, policy (in the dtype a CPU run of the preset decodes in, so
    the warm-up's answers and drafter are the product's, from its cache) and task."""
    from ..config import preset
    from ..models.policies import prepare_policy_folder
    from ..models.transformer import Transformer
    from ..trainer import make_run_task, resolve_dtype
    from .e2e import parse_overrides

    cfg = resolve_dtype(preset(args.preset, parse_overrides(args.set)), "cpu")
    folder = prepare_policy_folder(cfg)
    policy = Transformer.from_pretrained(folder, dtype=getattr(torch, cfg.model.dtype)).eval()
    return cfg, folder, policy, make_run_task(cfg, folder)


def cmd_recipes(args: argparse.Namespace) -> int:
    from ..learn.drafter_warmup import stop_ids, warmup_answers, weights_digest
    from ..models.linear import cpu_name
    from ..rollout.sampling import sampling_params
    from .progress import PhaseProgress

    cfg, folder, policy, task = _preset_policy(args)
    answers = warmup_answers(policy, task, cfg.drafter, sampling=sampling_params(cfg.rollout),
                             policy_key=weights_digest(folder), max_new_tokens=cfg.rollout.max_new_tokens,
                             seed=cfg.run.seed, on_progress=PhaseProgress("[bench coupling] warm-up answers").warmup)
    recipes = recipe_sections(args.preset, args.set, args.recipes, args.recipe_steps)
    depth = max((d for d, k, _ in cfg.spec.strategies if k == 1), default=max(d for d, _, _ in cfg.spec.strategies))
    scores = recipe_scores(policy, answers, recipes, args.holdout, cfg.spec.draft_vocab, cfg.rollout.temperature,
                           depth, stop_ids(policy, task), cfg.run.seed)
    print(json.dumps({"bench": "coupling", "mode": "recipes", "preset": args.preset, "overrides": args.set,
                      "cpu": cpu_name(), "answers": len(answers), "holdout": args.holdout, "steps": args.recipe_steps,
                      "temperature": cfg.rollout.temperature, "chain_depth": depth, "recipes": scores}))
    return 0


def cmd_coupling(args: argparse.Namespace) -> int:
    from ..learn.drafter_warmup import generate_answers, stop_ids, warmup_drafter, warmup_optimizer, weights_digest
    from ..models.linear import cpu_name
    from ..rollout.sampling import sampling_params
    from ..rollout.speculative import draft_vocab_ids
    from .progress import PhaseProgress

    if args.recipes is not None:
        return cmd_recipes(args)
    cfg, folder, policy, task = _preset_policy(args)
    sampling = sampling_params(cfg.rollout)
    print("[bench coupling] the drafter (the product's warm-up; cached after its first run)", file=sys.stderr, flush=True)
    progress = PhaseProgress("[bench coupling] drafter warm-up")
    drafter, warm = warmup_drafter(policy, task, cfg.drafter, sampling=sampling, policy_key=weights_digest(folder),
                                   max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.run.seed,
                                   on_progress=progress.warmup)
    eos = stop_ids(policy, task)
    cap = min(cfg.drafter.warmup_max_new_tokens, cfg.rollout.max_new_tokens)
    prompts = [p.ids for p in task.sample_prompts(args.prompts, random.Random(cfg.run.seed + 99_991))]  # not the warm-up's
    print(f"[bench coupling] the policy answers {len(prompts)} held-out prompts", file=sys.stderr, flush=True)
    answers = generate_answers(policy, prompts, sampling, args.held_out_tokens or cap, eos, cfg.run.seed + 1, None)
    ids = draft_vocab_ids(drafter.token_counts, cfg.spec.draft_vocab, eos) if cfg.spec.draft_vocab else None
    temps = args.temperatures or sorted({cfg.rollout.temperature, 1.0})
    sums: dict[float, dict[str, float]] = {t: {} for t in temps}
    n = 0
    gen = torch.Generator().manual_seed(0)
    by_pos = PositionMeans(sorted({*POSITION_EDGES, cap}))
    gaps: list[Tensor] = []
    for logits_p, logits_q in _logits(policy, drafter, answers, ids):
        n += logits_p.shape[0]
        for t in temps:
            p, q = _distributions(logits_p, logits_q, ids, t)
            figures, calib = second_candidates(p, q, args.gumbel_draws, gen)
            for k, v in {**agreements(p, q, args.gumbel_draws, gen), **figures}.items():
                sums[t][k] = sums[t].get(k, 0.0) + float(v.sum())
                if t == cfg.rollout.temperature and k == "race":
                    by_pos.add(v)
            if t == cfg.rollout.temperature:
                gaps.append(calib)
    out: dict[str, Any] = {"bench": "coupling", "preset": args.preset, "overrides": args.set, "positions": n,
                           "cpu": cpu_name(), "draft_vocab": cfg.spec.draft_vocab,
                           # the drafter's fit to its own training answers, beside the held-out figures
                           "warmup": {k: warm.get(k) for k in ("answers", "response_tokens", "steps", "train_top1",
                                                               "generate_s", "train_s", "cached")}}
    for t in temps:
        out[f"T{t:g}"] = {k: round(v / max(n, 1), 4) for k, v in sums[t].items()}
    out["by_position"] = {k: {"race": mean, "positions": count} for k, (mean, count) in by_pos.means().items()}
    out["runner_up_by_gap"] = gap_table(torch.cat(gaps))
    if args.draft_temperatures:
        out["by_draft_temperature"] = {
            f"{t:g}": {f"step{k}": round(keyed_agreement(policy, drafter, answers, ids, cfg.rollout.temperature, k, t), 4)
                       for k in (1, 2)} for t in args.draft_temperatures}
    if args.spot_lrs:
        n_rows = cfg.task.prompts_per_step
        batches = []
        for k in range(args.spot_steps):
            print(f"[bench coupling] spot training: the policy answers step {k + 1}/{args.spot_steps}", file=sys.stderr,
                  flush=True)
            step_prompts = task.sample_prompts(n_rows, random.Random(cfg.run.seed + 55_555 + k))
            rows = [p.ids for p in step_prompts for _ in range(cfg.rollout.samples_per_prompt)]
            batches.append(generate_answers(policy, rows, sampling, cap, eos, cfg.run.seed + 2 + k, None))
        out["spot"] = {"before": round(keyed_agreement(policy, drafter, answers, ids, cfg.rollout.temperature), 4),
                       "temperature": cfg.rollout.temperature, "epochs": cfg.drafter.spot_max_epochs or 1,
                       "response_tokens": [sum(len(t) - p for t, _, p in b) for b in batches], "after_each_step": {},
                       "fresh_adamw": {}}
        resumed = warmup_optimizer(warm["folder"])
        if resumed is None:
            raise SystemExit(f"the cached warm-up in {warm['folder']} has no optimizer state: delete it to train again")
        for lr in args.spot_lrs:
            print(f"[bench coupling] spot training at lr {lr:g}", file=sys.stderr, flush=True)
            for key, optimizer in (("after_each_step", resumed), ("fresh_adamw", None)):
                out["spot"][key][f"{lr:g}"] = spot_curve(policy, drafter, cfg, batches, answers, ids, lr, optimizer)
    print(json.dumps(out))
    return 0
