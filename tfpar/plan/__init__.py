"""The planner: which parallel layout to run a model with on given hardware
(`python -m tfpar.plan`)."""
