"""The bubble fraction of each pipeline schedule in closed form (bubble_formula): what the
simulator (autopar.cost.schedules.simulate) measures for equal stages and no communication
time, from the schedules' papers; the tests hold the simulator to it.  With S equal stages,
forward tf and backward tb per microbatch, B microbatches and v chunks:

    naive         one batch through S stages            bubble (S-1)/S
    gpipe, 1f1b   makespan (B+S-1)(tf+tb)               bubble (S-1)/(B+S-1)
    interleaved   makespan B(tf+tb) + (S-1)(tf+tb)/v     bubble (S-1)/(vB+S-1)
    zero-bubble   makespan B(tf+tb) + (S-1)(tf+tbB-tbW)  for B >= S and tbW <= min(tf, tbB),
                  where tb = tbB + tbW (ZB-H1; schedule_orders.zero_bubble_orders)
    zbv           makespan B(tf+tb) + (S-1) max(tbB, 2(tbB-tbW)) / 2   for B >= 2S and
                  tf, tbW <= tbB: with tf = tbB = tbW half ZB-H1's bubble, a sixth of
                  1F1B's, at 1F1B's peak activations (schedule_orders.zbv_orders)
    chimera       makespan B(tf+tb) + (S/2-1)(tf+tb)        for tb = tf, B a multiple of S
                  (two pipelines in opposite directions; schedule_orders.chimera_orders)
    pipedream-2bw step B max_s(tf+tb) in the steady state of a stream of steps, bubble 0 for
                  equal stages (asynchronous: weights one step stale)

Interleaved 1F1B follows Narayanan et al. 2021 ("Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM"); zero-bubble follows the ZB-H1 schedule of
Qi et al. 2023 ("Zero Bubble Pipeline Parallelism"); zbv the V-shaped schedule of its
section 6 (two chunks per rank, placed so that a microbatch's forward goes down the ranks
and comes back up, as does its backward).
"""
from __future__ import annotations

from autopar.cost.schedules import ASYNCHRONOUS, SCHEDULES


def bubble_formula(schedule: str, n_stages: int, n_microbatches: int, n_virtual: int = 1, *,
                   backward_ratio: float = 2.0, w_fraction: float = 0.5) -> float:
    """The bubble fraction `simulate` measures, in closed form, for equal stages and no
    communication time (S stages, B microbatches, v chunks, tf = 1, tb = backward_ratio):

        naive             (S-1) / S
        gpipe, 1f1b       (S-1) / (B + S-1)          bubble time (S-1)(tf+tb)
        interleaved-1f1b  (S-1) / (vB + S-1)         bubble time (S-1)(tf+tb)/v (Narayanan et al. 2021)
        zero-bubble       (S-1) x / (B(tf+tb) + (S-1) x),  x = max(tf, tbB, tf + tbB - tbW),
                          tbW = w_fraction tb, tbB = tb - tbW; for B >= S (ZB-H1, Qi et al. 2023)
        zbv               (S-1) y / (B(tf+tb) + (S-1) y),  y = max(tbB, 2(tbB - tbW)) / 2,
                          for B >= 2S and tf, tbW <= tbB (ZB-V, the same paper, section 6)
        chimera           (S-2) / (2B + S-2)         for tb = tf and B a multiple of S (Li and
                          Hoefler 2021, table 2): bubble time (S/2-1)(tf+tb), under half of 1F1B's
        pipedream-2bw     0                          for B >= S: the steady state of a stream of
                          steps without flushes (Narayanan et al. 2021), weights one step stale

    zero-bubble and zbv depend on backward_ratio: with the defaults x = tf, y = tf / 2 and
    the fractions are (S-1) / (3B + S-1) and (S-1) / (6B + S-1).  ZB-V's idle time is the
    last rank's wait for the first microbatch's forward to reach it ((S-1) half-stage
    forwards, the fill no schedule avoids); the rest of its warm-up and cool-down fill with
    W passes.
    """
    S, B, v = n_stages, n_microbatches, n_virtual
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule == "naive":
        return (S - 1) / S
    if schedule in ("gpipe", "1f1b"):
        return (S - 1) / (B + S - 1)
    if schedule == "interleaved-1f1b":
        if B % S:
            raise ValueError(f"interleaved-1f1b needs n_microbatches a multiple of n_stages={S}, got {B}")
        return (S - 1) / (v * B + S - 1)
    if schedule in ASYNCHRONOUS:
        if B < S:
            raise ValueError(f"{schedule} needs n_microbatches >= n_stages, got {B} < {S}")
        return 0.0
    if schedule == "chimera":
        if S % 2 or B % S or backward_ratio != 1.0:
            raise ValueError(f"the chimera closed form holds for an even number of stages, a multiple of them as "
                             f"microbatches and backward as long as forward; got {S} stages, {B} microbatches, "
                             f"backward_ratio {backward_ratio:g}: use simulate() instead")
        return (S - 2) / (2 * B + S - 2)
    tb_w = w_fraction * backward_ratio
    tb_b = backward_ratio - tb_w
    if schedule == "zbv":
        if B < 2 * S or tb_w > tb_b or tb_b < 1.0:
            raise ValueError(f"the zbv closed form holds for n_microbatches >= 2 n_stages and a weight pass and "
                             f"forward no longer than the input-gradient pass; got {B} microbatches for {S} stages, "
                             f"forward 1, input gradient {tb_b:g}, weight gradient {tb_w:g}: use simulate() instead")
        y = max(tb_b, 2.0 * (tb_b - tb_w)) / 2.0
        return (S - 1) * y / (B * (1.0 + backward_ratio) + (S - 1) * y)
    if B < S:
        raise ValueError(f"the zero-bubble closed form holds for n_microbatches >= n_stages, got {B} < {S}; "
                         f"use simulate() instead")
    x = max(1.0, tb_b, 1.0 + tb_b - tb_w)
    return (S - 1) * x / (B * (1.0 + backward_ratio) + (S - 1) * x)
