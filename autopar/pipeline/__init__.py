"""Pipeline-parallel schedules: simulate them on a timeline and draw the timeline.

    tl = simulate("1f1b", n_stages=4, n_microbatches=8)
    print(tl)                      # one row of passes per rank and the bubble fraction
    gantt_svg(tl, "1f1b.svg")
"""
from .gantt import gantt_svg, gantt_svg_text
from .measure import EventRecorder, PassTimes, gather_timeline, pass_times
from .simulate import SCHEDULES, Event, Timeline, bubble_formula, simulate

__all__ = ["SCHEDULES", "Event", "EventRecorder", "PassTimes", "Timeline", "bubble_formula", "gantt_svg",
           "gantt_svg_text", "gather_timeline", "pass_times", "simulate"]
