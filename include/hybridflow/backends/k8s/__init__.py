"""The Kubernetes gang backend: Volcano or Kueue jobs submitted through the provider's KubernetesHook.

``manifests`` builds the objects, ``backend`` submits, re-attaches, reads status and deletes,
``trigger`` waits for the outcome without holding a worker slot.
"""
