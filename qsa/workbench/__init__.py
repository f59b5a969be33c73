"""The workbench: per-op measurement, per-step roll-up, tuning, profiling, sweeps, plots."""
