"""Steps with stages: PipelineRunner on torch.distributed.pipelining (pipelined.py), Chimera's
two pipelines (two_way.py), PipeDream-2BW (flushless.py), and the passes of a real schedule
timed (pass_times.py)."""
