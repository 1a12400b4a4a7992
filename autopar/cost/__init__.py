"""Stage 3, prices: what a strategy costs in time and memory.

prices.py (compute roofline, collective and redistribution prices), collective_prices.py (one
collective call or send priced on mesh axes), collectives.py (collective algorithms, alpha-beta),
redistribution.py (the one planner of the steps between two layouts), memory.py (model states
under ZeRO), saved.py (what each op keeps for backward), precision.py (mixed precision),
schedules.py (pipeline schedules on a timeline), schedule_orders.py (each rank's order of
passes), pass_graph.py (a schedule's passes as a dependency graph), bubbles.py (bubbles in
closed form)."""
