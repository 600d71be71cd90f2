"""experiments: the Ray world of gptrun — Ray Train runs, Ray Tune sweeps, reports and the CLI."""
