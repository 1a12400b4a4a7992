"""Each rank's order of passes under each pipeline schedule, for the simulator
(autopar.cost.schedules) and the runtime to share.

An order is a list of ops (kind, microbatch, chunk), kind "F" (forward), "B" (backward,
under the split-backward schedules its input-gradient part) or "W" (weight gradient), in
the order the rank runs them; the builders take S ranks and B microbatches and return one
order per rank.  Where a chunk's stage sits (loop, V or two-way placement) is
autopar.cost.schedules' (stage_of, place_of).

Interleaved 1F1B follows Narayanan et al. 2021 ("Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM"); zero-bubble follows the ZB-H1 schedule of
Qi et al. 2023 ("Zero Bubble Pipeline Parallelism"); zbv the V-shaped schedule of its
section 6; dualpipev DeepSeek-AI 2025; chimera Li and Hoefler 2021.
"""
from __future__ import annotations

import heapq

from functools import lru_cache

Op = tuple  # (kind, microbatch, chunk)


def peak_in_flight(kinds: list) -> int:
    """Most microbatches held at once over one rank's passes, given their kinds in the order
    they run (see Timeline.max_in_flight)."""
    last = "W" if "W" in kinds else "B"
    held = peak = 0
    for kind in kinds:
        held += (kind == "F") - (kind == last)
        peak = max(peak, held)
    return peak


def gpipe_orders(S: int, B: int) -> list:
    """All forwards in order, then all backwards in reverse order, on every rank."""
    return [[("F", m, 0) for m in range(B)] + [("B", m, 0) for m in reversed(range(B))] for _ in range(S)]


def one_f_one_b_orders(S: int, B: int, v: int = 1) -> list:
    """1F1B (PipeDream-flush) and, for v > 1, interleaved 1F1B as in Megatron-LM.

    Rank r runs its k-th forward on chunk (k // S) % v of microbatch (k // (S v)) S + k % S
    (microbatches go in groups of S through each chunk in turn), and its backwards in the
    same order with the chunks reversed.  Warmup: (S - r - 1) forwards for v = 1;
    2 (S - r - 1) + (v - 1) S for v > 1; then one forward, one backward; then the rest
    of the backwards.
    """
    total = B * v

    def op(kind: str, k: int) -> Op:
        chunk = (k // S) % v
        return kind, (k // (S * v)) * S + k % S, v - 1 - chunk if kind == "B" else chunk

    orders = []
    for r in range(S):
        warmup = min(S - r - 1 if v == 1 else 2 * (S - r - 1) + (v - 1) * S, total)
        order = [op("F", k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [op("F", warmup + i), op("B", i)]
        order += [op("B", k) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def zero_bubble_orders(S: int, B: int) -> list:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the 1F1B order with each
    backward split into B (input gradient, on the critical path) and W (weight gradient,
    needed only by the optimizer step).  Rank r runs W(i) right after B(i + r) and the
    last r W's after its final B, so the tail bubbles fill with W's while every rank
    holds at most S microbatches, the peak of 1F1B.

    With equal stages and B >= S the bubble is (S-1) max(tf, tb_B, tf + tb_B - tb_W) per
    rank, which is (S-1)(tf + tb_B - tb_W) as in the paper when tb_W <= min(tf, tb_B):
    with the default split (tb_B = tb_W = tf) a third of 1F1B's (S-1)(tf + tb).
    """
    orders = []
    for r, order in enumerate(one_f_one_b_orders(S, B)):
        split, n_b = [], 0
        for kind, m, c in order:
            split.append((kind, m, c))
            if kind == "B":
                if n_b >= r:
                    split.append(("W", n_b - r, 0))
                n_b += 1
        orders.append(split + [("W", m, 0) for m in range(max(B - r, 0), B)])
    return orders


def zbv_orders(S: int, B: int) -> list:
    """ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6): chunk 0 of rank
    r is stage r and chunk 1 stage 2S-1-r; backward split into B and W as in ZB-H1.

    Per rank r, with n = max(B, 2S-1) microbatches planned and those past B dropped:
    warm-up 2(S-r)-1 forwards of chunk 0, then r times (forward chunk 1, forward chunk 0),
    then S-r times (forward, B, W of chunk 1); steady state (forward, B, W of chunk 0, then
    of chunk 1) until every forward ran; cool-down r times (B chunk 0, B chunk 1), S-r
    times (B, W of chunk 0), then the W's left, chunk 1's first.  A rank holds at most 2S
    chunks' activations (S stages' worth, as 1F1B), and with tf = tbB = tbW the steady
    state has no idle time."""
    n = max(B, 2 * S - 1)
    orders = []
    for r in range(S):
        order: list = []
        done = {kind: [0, 0] for kind in "FBW"}

        def run(kind: str, chunk: int) -> None:
            order.append((kind, done[kind][chunk], chunk))
            done[kind][chunk] += 1

        for _ in range(2 * (S - r) - 1):
            run("F", 0)
        for _ in range(r):
            run("F", 1)
            run("F", 0)
        for _ in range(S - r):
            for kind in "FBW":
                run(kind, 1)
        while done["F"][1] < done["F"][0] or done["F"][0] < n:
            if done["F"][0] < n:
                run("F", 0)
            run("B", 0)
            run("W", 0)
            for kind in "FBW":
                run(kind, 1)
        for _ in range(r):
            run("B", 0)
            run("B", 1)
        for _ in range(S - r):
            run("B", 0)
            run("W", 0)
        for chunk in (1, 0):
            while done["W"][chunk] < done["B"][chunk]:
                run("W", chunk)
        orders.append([op for op in order if op[1] < B])
    return orders


def dualpipev_orders(S: int, B: int) -> list:
    """DualPipeV (DeepSeek-AI 2025, "DeepSeek-V3 Technical Report", section 3.2.1, in the
    V-shaped "cut-in-half" form): the V placement of zbv, a microbatch's backward of one
    chunk paired with another's forward of the other (F&B: the pair starts when both can,
    and on GPUs each hides the other's communication; here they run one after the other,
    F&B = F + B), and weight passes deferred only
    where they fill the warm-up and cool-down.  A backward with its weight pass right after
    it is a full backward.  Per rank r (n = B >= 2S microbatches):

        2(S-r-1) x F0;  (r+1) x (F0 F1);  (S-r-1) x (B1, deferred W, F1);
        (n-2S+r+1) x (F0 B1W1, F1 B0W0) (on the last rank the first F0 and B1 unpaired);
        (S-r-1) x (B1W1, F1 B0W0);
        (r+1) x (B1, B0), the second half with W deferred;  (S-r-1) x (W, B0 deferred);
        (r+1) x W

    where a deferred W runs the oldest waiting weight pass.  Returns the orders and the
    pairs {(rank, forward): backward}."""
    orders, pairs = [], {}
    for r in range(S):
        order: list = []
        count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        waiting: list = []

        def forward(chunk: int) -> None:
            order.append(("F", count["F", chunk], chunk))
            count["F", chunk] += 1

        def backward(chunk: int, defer: bool = False) -> None:
            op = ("B", count["B", chunk], chunk)
            count["B", chunk] += 1
            order.append(op)
            if defer:
                waiting.append(("W", op[1], chunk))
            else:
                order.append(("W", op[1], chunk))

        def weight() -> None:
            order.append(waiting.pop(0))

        for _ in range(2 * (S - r - 1)):
            forward(0)
        for _ in range(r + 1):
            forward(0)
            forward(1)
        for _ in range(S - r - 1):
            backward(1, defer=True)
            weight()
            forward(1)
        def pair(f_chunk: int, b_chunk: int) -> None:
            pairs[r, ("F", count["F", f_chunk], f_chunk)] = ("B", count["B", b_chunk], b_chunk)
            forward(f_chunk)
            backward(b_chunk)

        for i in range(B - 2 * S + r + 1):
            if i == 0 and r == S - 1:   # the last rank's first two are not paired (less idle time)
                forward(0)
                backward(1)
            else:
                pair(0, 1)
            pair(1, 0)
        for _ in range(S - r - 1):
            backward(1)
            pair(1, 0)
        defer = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                defer = True
            backward(1, defer)
            if i == (r + 1) // 2 and r % 2 == 0:
                defer = True
            backward(0, defer)
        for _ in range(S - r - 1):
            weight()
            backward(0, defer=True)
        while waiting:
            weight()
        orders.append(order)
    return orders, pairs


def chimera_orders(S: int, B: int) -> list:
    """Chimera (Li and Hoefler 2021, "Chimera: Efficiently Training Large-Scale Neural
    Networks with Bidirectional Pipelines"): two pipelines over the same S ranks (S even),
    the down pipeline placing stage k on rank k (chunk 0), the up pipeline on rank S-1-k
    (chunk 1).  Of each S microbatches the first S/2 go down, the rest up.

    The order is the list schedule of both pipelines at equal pass times: whenever a rank
    is free it runs a ready backward first (the shallower stage's first), else a ready
    forward (the deeper stage's first), with at most min(S/2, S-k) microbatches in flight
    on stage k, as 1F1B would hold for S/2.  At backward = forward this is the paper's
    schedule: (S/2-1)(tf+tb) idle per rank for any multiple of S microbatches (its
    bubble ratio (D-2)/(2N+D-2)), stage k's rank holding S/2 + 1 to S microbatches.
    Longer backwards leave gaps between consecutive units of S (the paper's "direct
    concatenation")."""
    return [list(order) for order in _chimera_cached(S, B)]


@lru_cache(maxsize=256)
def _chimera_cached(S: int, B: int) -> tuple:
    half = S // 2
    queue = {c: [m for m in range(B) if (m % S >= half) == c] for c in (0, 1)}   # microbatches per pipeline
    end = [-1.0] * (S * 4 * B)   # ((rank 2 + kind) 2 + chunk) B + microbatch -> its end (kind: F 0, B 1)
    free = [0.0] * S
    started = [[0, 0] for _ in range(S)]
    held = [[[], []] for _ in range(S)]      # forwards waiting for their backward, per chunk
    orders = [[] for _ in range(S)]

    def candidate(r):
        """Rank r's next pass if one is ready: (start, ...ordering keys, op), or None.  It
        depends on rank r's own state and on its neighbours' ends only (pass_inputs: a
        forward waits for the stage before's forward, a backward for the stage after's
        backward; its own forward ran when it was taken)."""
        best = None
        for c in (0, 1):
            k = r if c == 0 else S - 1 - r
            step = 1 if c == 0 else -1    # the next stage's rank is r + step
            mine = held[r][c]
            if mine:
                m = mine[0]
                t = free[r]
                if k < S - 1:
                    after = end[(((r + step) * 2 + 1) * 2 + c) * B + m]
                    t = None if after < 0 else max(t, after)
                if t is not None:
                    got = (t, False, k, ("B", m, c))
                    best = got if best is None or got < best else best
            if started[r][c] < len(queue[c]) and len(mine) < min(half, S - k):
                m = queue[c][started[r][c]]
                t = free[r]
                if k > 0:
                    before = end[(((r - step) * 2) * 2 + c) * B + m]
                    t = None if before < 0 else max(t, before)
                if t is not None:
                    got = (t, True, -k, ("F", m, c))
                    best = got if best is None or got < best else best
        return best

    # the earliest ready pass over all ranks, the lowest rank on a tie; a heap of each rank's
    # candidate, recomputed only where a pass changed what is ready (its rank and neighbours)
    version = [0] * S
    heap = []
    for r in range(S):
        got = candidate(r)
        if got is not None:
            heap.append((got[0], r, 0, got[3]))
    heapq.heapify(heap)
    for _ in range(2 * B * S):
        while True:
            t, r, ver, op = heapq.heappop(heap)
            if ver == version[r]:
                break
        kind, m, c = op
        free[r] = end[((r * 2 + (kind == "B")) * 2 + c) * B + m] = t + 1.0
        orders[r].append(op)
        if kind == "F":
            held[r][c].append(m)
            started[r][c] += 1
        else:
            held[r][c].remove(m)
        for r2 in (r - 1, r, r + 1):
            if 0 <= r2 < S:
                version[r2] += 1
                got = candidate(r2)
                if got is not None:
                    heapq.heappush(heap, (got[0], r2, version[r2], got[3]))
    return tuple(tuple(o) for o in orders)
