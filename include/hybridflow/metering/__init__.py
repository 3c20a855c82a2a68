"""GPU metering: dcgm-exporter and Prometheus sources turned into per-GPU samples for the ledger."""
