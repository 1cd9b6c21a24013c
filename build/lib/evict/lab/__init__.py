"""Labs: sweeps of small experiments that produce a table, plots and a scorecard."""
