"""What researchers read from the ledgers: the metric-by-step table (`watcher results`,
`table.py`), the plot (`watcher plot`, `plot.py`), per-document records and what flipped
between steps (`watcher samples`, `samples.py`), and the run's HTML page (`watcher report`,
`page.py`). Reads ledgers and result files; writes nothing the daemon relies on."""
