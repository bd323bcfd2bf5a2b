"""Scale-out: Ray worker groups for the FSDP2 student, rollout engines and teacher pools (``cluster:``)."""
