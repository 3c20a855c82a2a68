"""A real Kubernetes test control plane for dev and CI, built from Go modules (see ``build``)."""
