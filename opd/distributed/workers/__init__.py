"""Ray plumbing: the private cluster, worker groups, their dispatch and each worker's environment."""
