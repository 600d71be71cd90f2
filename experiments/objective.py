"""What every sweep minimizes, in one place for Tune, Optuna and the report (a module of its own
so that the report and warm starts can read it without importing the trial's torch)."""

METRIC = "val_loss"  # what each trial reports and the searchers rank by
MODE = "min"  # the direction in Tune's words
DIRECTION = "minimize"  # the same in Optuna's
