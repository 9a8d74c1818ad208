"""Speculative decoding pieces: drafting (EAGLE chain/tree, n-gram) and lossless verification.

engine.py owns the loop; this module holds the parts it calls once per verify pass:

    tree = draft(drafter, dcache, hid, seq, lengths, s_max, depth=4, topk=1, verify=4, ...)
    anc = ancestors(tree)                                   # [B, T, T]
    mask = tree_mask(lengths, anc, s_max + T)               # cache prefix + own ancestors
    ... target forward over tree.tokens ...
    path, n_acc, nxt = walk(tree, y, stats)                 # y: the target's token at every node

A draft is a `Tree` rooted at each row's *pending* token: the token already emitted at cache
position n = cache.lengths[b] but not yet fed to the target. A plain decode step is the tree with
only the root, so one verification routine serves plain decoding, chains and trees.

Drafter state. The drafter's KV cache holds entries computed from the target's TRUE hidden states:
pair (h_i, x_{i+1}) at drafter position i, for i < dcache.lengths[b]. Before drafting, `catch_up`
feeds every pair the drafter has not seen yet (the positions accepted by the last verify pass, or
all positions decoded while SD was off) in one batched call, reading the hidden states the rollout
harvests anyway. Its last pair (h_{n-1}, x_n) predicts the first draft token. So switching SD
off costs nothing per step and switching it on needs no target re-prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from ..models.linear import Linear
from ..models.transformer import KVCache
from .sampling import SamplingParams, draw, process


class Tree(NamedTuple):
    tokens: Tensor  # [B, T] node tokens; node 0 is the row's pending token
    parent: Tensor  # [B, T] parent node index; -1 for the root and for padding nodes
    depth: Tensor  # [B, T] distance from the root (rope position = n + depth)
    valid: Tensor  # [B, T] False for padding (rows whose draft is shorter)
    max_depth: int  # deepest level any row may have
    chain: bool  # node j sits at depth j under node j-1: accepted paths need no KV compaction


@dataclass
class SpecStats:
    """Per-rollout acceptance counters, kept on the device so the hot loop never syncs for them."""

    max_depth: int
    device: torch.device
    # [len(KINDS), D], one row per kind of pass. A drafter chain's rate at position j+1 does not
    # depend on how deep the chain goes, so its row compares drafters whatever depths a bandit picked
    KINDS = ("chain", "tree", "ngram", "hybrid")  # the drafter's chains and trees, n-gram drafts, n-gram else drafter
    attempted: Tensor = field(init=False)  # row-passes that had a candidate at draft position j+1
    accepted: Tensor = field(init=False)  # row-passes that accepted draft position j+1
    hist: Tensor = field(init=False)  # [len(KINDS), D + 1] row-passes by number of accepted draft tokens

    def __post_init__(self) -> None:
        self.attempted = torch.zeros(len(self.KINDS), self.max_depth, dtype=torch.long, device=self.device)
        self.accepted = torch.zeros(len(self.KINDS), self.max_depth, dtype=torch.long, device=self.device)
        self.hist = torch.zeros(len(self.KINDS), self.max_depth + 1, dtype=torch.long, device=self.device)


def root_tree(roots: Tensor) -> Tree:
    """The draft-free tree: a plain decode step of the pending tokens roots [B]."""
    B = roots.shape[0]
    z = torch.zeros(B, 1, dtype=torch.long, device=roots.device)
    return Tree(roots[:, None], z - 1, z, torch.ones(B, 1, dtype=torch.bool, device=roots.device), 0, True)


def ancestors(tree: Tree) -> Tensor:
    """anc[b, i, j]: node j is node i or one of its ancestors. Nodes come in topological order."""
    B, T = tree.tokens.shape
    dev = tree.tokens.device
    eye = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T)
    if tree.chain:
        # valid nodes of a chain form a prefix: node i sees nodes 0..i; a padding node sees itself
        return torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev)) & tree.valid[:, :, None] | eye
    anc = eye.clone()
    rows = torch.arange(B, device=dev)
    for i in range(1, T):
        par = tree.parent[:, i]
        anc[:, i] |= anc[rows, par.clamp(min=0)] & (par >= 0)[:, None]
    return anc


def tree_mask(lengths: Tensor, anc: Tensor, S: int) -> Tensor:
    """[B, T, S] attention mask for tree nodes written at cache slots n..n+T-1 (n = lengths[b]).

    Node i sees the row's cache prefix (keys < n) and the slots of its ancestors and itself.
    """
    B, T, _ = anc.shape
    keys = torch.arange(S, device=lengths.device)
    prefix = keys[None, :] < lengths[:, None]  # [B, S]
    rel = keys[None, :] - lengths[:, None]  # slot offset inside the tree region
    inside = (rel >= 0) & (rel < T)
    tree = anc.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, S)) & inside[:, None, :]
    return prefix[:, None, :] | tree


# --- the drafter ---------------------------------------------------------------------------------

class DraftHead:
    """The drafter's LM head, optionally restricted to a reduced draft vocabulary (FR-Spec style).

    Each draft step of an EAGLE drafter ends in the target's LM head; on a CPU that [V, H] matrix
    product (V = 49152 for SmolLM2) costs more than the drafter's decoder layer. With `ids` (sorted,
    unique token ids, e.g. the most frequent few thousand in the drafter's training data plus EOS)
    drafting computes logits over that subset only: q is the softmax over the subset and q = 0
    outside it. Verification still uses the target's full distribution p, so the rollout stays
    lossless: greedy accepts only tokens equal to the target's argmax, and sampled chains use the
    speculative-sampling rule with this q, the distribution the drafts were really drawn from.

    `logits(h)` -> [..., V'] over the subset (V' = len(ids), or V without ids); `token(i)` maps
    subset indices back to vocabulary ids; `full(q)` scatters a subset distribution into [..., V].
    """

    def __init__(self, drafter, ids: Tensor | None = None, vocab_size: int | None = None,
                 device: torch.device | str | None = None):
        self.drafter = drafter
        self.ids = ids
        self.vocab_size = vocab_size
        self.head: Linear | None = None
        if ids is not None:
            if vocab_size is None:
                raise ValueError("a reduced draft vocabulary needs the full vocab_size")
            w = _head_weight(drafter)
            self.ids = ids = ids.to(w.device if w is not None else device or ids.device)
            if w is not None:
                with torch.inference_mode(False):  # a normal tensor: Linear's packed kernels need one
                    self.head = Linear.frozen(w.detach().index_select(0, ids))  # [V', H]: one small matmul per step

    def logits(self, h: Tensor) -> Tensor:
        if self.ids is None:
            return self.drafter.logits(h)
        if self.head is not None:
            return self.head(h)
        return self.drafter.logits(h).index_select(-1, self.ids)  # generic drafter: correct, not faster

    def token(self, i: Tensor) -> Tensor:
        return i if self.ids is None else self.ids[i]

    def full(self, q: Tensor) -> Tensor:
        if self.ids is None:
            return q
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.ids, q)


def _head_weight(drafter) -> Tensor | None:
    """The [V, H] LM-head weight an EAGLE drafter shares with its target (None: unknown drafter)."""
    try:
        head = drafter.target.lm_head
    except (AttributeError, RuntimeError):
        return None
    w = getattr(head, "weight", None)
    return w if isinstance(w, Tensor) and w.dim() == 2 else None


def draft_vocab_ids(counts: Tensor, size: int, always: Sequence[int] = ()) -> Tensor:
    """The `size` most frequent token ids by `counts` [V] (plus `always`, e.g. EOS ids), sorted."""
    V = counts.shape[0]
    size = max(1, min(int(size), V))
    top = torch.topk(counts.double() + torch.arange(V, 0, -1, dtype=torch.float64) * 1e-9, size).indices
    keep = set(top.tolist()) | {int(a) for a in always if 0 <= int(a) < V}
    return torch.tensor(sorted(keep), dtype=torch.long)


def catch_up(drafter, dcache: KVCache, hid: Tensor, seq: Tensor, lengths: Tensor) -> Tensor:
    """Feed the drafter every pair (h_i, x_{i+1}) it has not seen, i in [dcache.lengths, lengths).

    hid: [B, L, H] true target hidden states, seq: [B, L] tokens (seq[b, n] = pending token).
    Rows are right-padded to the longest gap; padded queries write past the row's length, where
    entries are garbage by contract. Returns the drafter output of each row's last pair
    (h_{n-1}, x_n) -> [B, H], whose logits propose the token after the pending one.
    Afterwards dcache.lengths == lengths: every cached drafter entry came from true states.
    """
    B = lengths.shape[0]
    rows = torch.arange(B, device=lengths.device)
    start = torch.minimum(dcache.lengths, lengths - 1)  # >= 1 pair per row (finished rows redo their last)
    count = lengths - start
    T = int(count.max())
    i = start[:, None] + torch.arange(T, device=lengths.device)  # [B, T] drafter positions
    src = torch.minimum(i, (lengths - 1)[:, None])
    h = hid[rows[:, None], src]  # [B, T, H]
    x = seq[rows[:, None], src + 1]  # [B, T]
    dcache.lengths = start
    out = drafter(h, x, positions=i, cache=dcache, write_pos=i.clamp(max=dcache.max_len - 1),
                  mask=_causal(start, T, int(start.max()) + T))
    dcache.lengths = lengths.clone()
    return out[rows, count - 1]


def _causal(lengths: Tensor, T: int, S: int) -> Tensor:
    keys = torch.arange(S, device=lengths.device)
    limit = lengths[:, None] + torch.arange(T, device=lengths.device)[None, :] + 1
    return keys[None, None, :] < limit[:, :, None]


def draft(drafter, dcache: KVCache, hid: Tensor, seq: Tensor, lengths: Tensor, s_max: int, *,
          depth: int, topk: int, verify: int, params: SamplingParams, keys: Tensor | None = None,
          head: DraftHead | None = None) -> Tree:
    """Draft a chain (topk == 1) or a tree for every row; s_max = max(lengths) as a host int.

    Chain: depth drafter steps. Greedy: each token the drafter's argmax. Sampling: each token is the
    keyed draw (sampling.draw) from the drafter's processed distribution q with the SAME noise the
    target will race with at that position (keys [B]: the rows' sample keys; level j drafts position
    lengths + j), so the draft is exactly the token plain decoding draws whenever the same token
    finishes first under q and under p.
    Tree (EAGLE-2 style dynamic tree): level 1 = the top-k tokens after the root; each further
    level expands the k best frontier nodes (by cumulative drafter log-prob) into k children each;
    finally the `verify` best candidates over all levels are kept. A child's score is below its
    parent's, so the kept set is closed under ancestors. Drafter slots of the tree region start at
    n; they are garbage after the pass (the next catch_up rewrites them from true states).
    head: the drafter's LM head, possibly over a reduced draft vocabulary (DraftHead); default: full.
    """
    B = lengths.shape[0]
    dev = lengths.device
    rows = torch.arange(B, device=dev)
    head = head if head is not None else DraftHead(drafter)
    h = catch_up(drafter, dcache, hid, seq, lengths)  # [B, H]
    root = seq[rows, lengths]
    logits = head.logits(h)  # [B, V']
    sampled = not params.greedy
    if sampled and keys is None:
        raise ValueError("sampled drafts need the rows' sample keys (sampling.sample_keys)")

    if topk == 1:
        toks = []
        x, tok = h[:, None], root
        for level in range(1, depth + 1):
            if level > 1:
                pos = (lengths + level - 2)[:, None]  # drafter position of the previous draft token
                x = drafter(x, tok[:, None], positions=pos, cache=dcache, write_pos=pos,
                            mask=_causal(pos[:, 0], 1, s_max + level - 1))
                logits = head.logits(x[:, 0])
            # the reduced vocabulary races with the noise of its tokens' full-vocabulary ids (head.ids)
            tok = head.token(draw(process(logits, params), keys, lengths + level, head.ids) if sampled
                             else logits.argmax(-1))
            toks.append(tok)
        tokens = torch.stack([root] + toks, 1)  # [B, D + 1]
        ar = torch.arange(depth + 1, device=dev).expand(B, -1)
        return Tree(tokens, ar - 1, ar, torch.ones_like(tokens, dtype=torch.bool), depth, True)

    K = topk
    R = max(1, (depth - 1) * K)  # drafter slots of the tree region
    H = h.shape[-1]

    def children(lg: Tensor, level: int) -> tuple[Tensor, Tensor]:
        """The K best children of each node: greedy, the drafter's likeliest tokens, scored by their
        log-probs. Sampling: the first K to finish the drafter's race at the level's position (the
        coupled draw, then its runners-up: where the target's draw is not the drafter's, it is most
        often the drafter's runner-up, `bench coupling`), the draw scored as certain (0, never above
        its parent) and the k-th runner-up as the drafter's k-th likeliest token."""
        v, t = torch.log_softmax(lg.float(), -1).topk(K, -1)
        if sampled:
            pos = (lengths + level).reshape(B, *([1] * (lg.dim() - 2))).expand(lg.shape[:-1])
            t = draw(process(lg, params), keys, pos, head.ids, places=K)
            v = torch.cat([torch.zeros_like(v[..., :1]), v[..., 1:]], -1)
        return v, head.token(t)

    score, tok = children(logits, 1)  # [B, K]
    pool_tok, pool_score = [tok], [score]
    pool_par = [torch.full((B, K), -1, dtype=torch.long, device=dev)]
    pool_dep = [torch.ones(B, K, dtype=torch.long, device=dev)]
    front = torch.arange(K, device=dev).expand(B, K)  # pool indices of the frontier
    ph = h[:, None].expand(B, K, H)  # drafter input state of each frontier node (its parent's output)
    anc = torch.zeros(B, K, R, dtype=torch.bool, device=dev)
    ark = torch.arange(K, device=dev)
    anc[:, ark, ark] = True  # level-1 nodes occupy slots 0..K-1
    offset = K
    slots = torch.arange(s_max + R, device=dev)
    rel = slots[None, :] - lengths[:, None]  # [B, S]
    inside = (rel >= 0) & (rel < R)
    prefix = (slots[None, :] < lengths[:, None])[:, None, :]
    for level in range(2, depth + 1):
        slot0 = (level - 2) * K
        pos = (lengths + level - 2)[:, None].expand(B, K)
        wp = lengths[:, None] + slot0 + torch.arange(K, device=dev)
        mask = prefix | (anc.gather(2, rel.clamp(0, R - 1)[:, None, :].expand(B, K, -1)) & inside[:, None, :])
        out = drafter(ph, tok, positions=pos, cache=dcache, write_pos=wp, mask=mask)  # [B, K, H]
        v, t = children(head.logits(out), level)  # [B, K, K]
        cs = (score[:, :, None] + v).flatten(1)  # [B, K*K] cumulative log-prob of each child
        ct = t.flatten(1)
        pool_tok.append(ct)
        pool_score.append(cs)
        pool_par.append(front[:, :, None].expand(B, K, K).flatten(1))
        pool_dep.append(torch.full((B, K * K), level, dtype=torch.long, device=dev))
        if level < depth:
            score, sel = cs.topk(K, -1)
            tok = ct.gather(1, sel)
            par_k = sel // K
            front = offset + sel
            ph = out.gather(1, par_k[..., None].expand(B, K, H))
            anc = anc.gather(1, par_k[..., None].expand(B, K, R)).clone()
            anc[:, ark, (level - 1) * K + ark] = True
        offset += K * K

    ptok, pscore = torch.cat(pool_tok, 1), torch.cat(pool_score, 1)
    ppar, pdep = torch.cat(pool_par, 1), torch.cat(pool_dep, 1)
    return tree_from_pool(root, ptok, pscore, ppar, pdep, verify, depth)


def tree_from_pool(root: Tensor, ptok: Tensor, pscore: Tensor, ppar: Tensor, pdep: Tensor, verify: int,
                   depth: int) -> Tree:
    """The `verify` best candidates of a drafted pool as a Tree under each row's root.

    root [B]; pool [B, M] in level order: token, cumulative score, parent pool index (-1: the
    root), depth. A child's score is below its parent's, and a depth penalty breaks rounded ties,
    so the kept set is closed under ancestors; should scores ever come out of order anyway, a kept
    node whose parent was not kept is marked invalid (never accepted), since reattaching it to the
    root would put its token at the wrong position.
    """
    B, M = ptok.shape
    dev = ptok.device
    if M > verify:
        sel = (pscore - 1e-3 * pdep).topk(verify, -1).indices.sort(1).values  # pool order = level order
    else:
        sel = torch.arange(M, device=dev).expand(B, M)
    N = sel.shape[1]
    table = torch.zeros(B, M + 1, dtype=torch.long, device=dev)  # pool index + 1 -> node index
    table.scatter_(1, sel + 1, torch.arange(1, N + 1, device=dev).expand(B, N))
    parent = table.gather(1, ppar.gather(1, sel) + 1)
    dep = pdep.gather(1, sel)
    kept = (dep == 1) | (parent > 0)  # parent 0 at depth > 1: an orphan
    zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
    tokens = torch.cat([root[:, None], ptok.gather(1, sel)], 1)
    return Tree(tokens, torch.cat([zero - 1, parent], 1), torch.cat([zero, dep], 1),
                torch.cat([torch.ones(B, 1, dtype=torch.bool, device=dev), kept], 1), depth, False)


# --- the n-gram drafter ----------------------------------------------------------------------------

def ngram_propose(context: Sequence[int], others: Sequence[np.ndarray], n_max: int, depth: int,
                  n_min: int = 1) -> list[int]:
    """Continue `context` by matching its last n tokens (n = n_max..n_min, longest first).

    Looks in the context itself (latest earlier occurrence) and then in `others` (sibling
    sequences of the same prompt); returns up to `depth` tokens that followed the match.
    """
    ctx = np.asarray(context, dtype=np.int64)
    for n in range(min(n_max, len(ctx) - 1), max(n_min, 1) - 1, -1):
        pat = ctx[-n:]
        own = ctx[:-1]  # a match must end before the last token, so a continuation exists
        if len(own) >= n:
            hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(own, n) == pat).all(1))
            if len(hits):
                i = hits[-1] + n
                return ctx[i:i + depth].tolist()
        for seq in others:
            if len(seq) <= n:
                continue
            hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(seq[:-1], n) == pat).all(1))
            if len(hits):
                i = hits[0] + n
                return seq[i:i + depth].tolist()
    return []


def chain_tree(roots: Tensor, proposals: list[list[int]], depth: int) -> Tree:
    """A chain tree from per-row proposals of varying length (shorter rows padded, invalid)."""
    B = roots.shape[0]
    dev = roots.device
    D = max(1, min(depth, max((len(p) for p in proposals), default=0)))
    toks = torch.zeros(B, D + 1, dtype=torch.long)
    valid = torch.zeros(B, D + 1, dtype=torch.bool)
    for b, p in enumerate(proposals):
        p = p[:D]
        toks[b, 1:1 + len(p)] = torch.tensor(p, dtype=torch.long)
        valid[b, :1 + len(p)] = True
    toks, valid = toks.to(dev), valid.to(dev)
    toks[:, 0] = roots
    ar = torch.arange(D + 1, device=dev).expand(B, -1)
    parent = torch.where(valid, ar - 1, torch.full_like(ar, -1))
    return Tree(toks, parent, ar, valid, D, True)


# --- lossless verification -------------------------------------------------------------------------

def walk(tree: Tree, y: Tensor, stats: SpecStats | None = None, kind: str = "chain") -> tuple[Tensor, Tensor, Tensor]:
    """Accept the drafted path that agrees with the target's own choices: the one verification rule.

    y: [B, T] the target's token at every node: its argmax (greedy), or its keyed draw from the
    processed target distribution p at that node with the noise of the node's next position
    (sampling.draw). Starting at the root, descend to the child whose token equals y[node];
    stop when no child matches and emit y[node].

    Lossless, token for token: every node on the accepted path has exactly the prefix plain decoding
    would have, and y[node] is the token plain decoding draws there (same p, same noise), so the
    emitted sequence IS the plain-decoding sequence; drafts only decide how far one pass gets. Each
    position's noise decides one emitted token and is independent of the prefix, so each token has
    law p.
    Greedy is the same rule with argmax.

    Returns path [B, D+1] (node index at each accepted depth; repeats the last node past n_acc),
    n_acc [B] (draft tokens accepted) and nxt [B] (the token emitted after them).
    """
    B = y.shape[0]
    dev = y.device
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    path = [cur]
    row = SpecStats.KINDS.index(kind)  # which of stats' counters this pass books
    for j in range(tree.max_depth):
        want = y.gather(1, cur[:, None])  # [B, 1] the target's token after the current node
        child = (tree.parent == cur[:, None]) & tree.valid
        match = child & (tree.tokens == want)
        hit = match.any(1) & active
        if stats is not None:
            stats.attempted[row, j] += (child.any(1) & active).sum()
            stats.accepted[row, j] += hit.sum()
        cur = torch.where(hit, match.int().argmax(1), cur)
        n_acc += hit.long()
        active = hit
        path.append(cur)
    if stats is not None:
        stats.hist[row].index_add_(0, n_acc, torch.ones_like(n_acc))
    return torch.stack(path, 1), n_acc, y.gather(1, cur[:, None])[:, 0]
