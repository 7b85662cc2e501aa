"""The decisions, pure (no process groups): the named axes, the layout, pipeline cuts, the planner and its cost model."""
