"""The Ray backend's driver side: ``RayBackend``, its registry and its connection."""
