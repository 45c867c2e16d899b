"""Where results and the daemon's health go besides the ledger: Prometheus metrics,
regression alerts, webhooks."""
