"""Refit: copying the student's new weights into the rollout engines, by bucket, over a transport."""
