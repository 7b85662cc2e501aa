"""The run: the driver and its states, the rank actors, the step loop, recovery and growth, reporting."""
