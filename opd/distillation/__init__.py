"""The distillation algorithm: its config, the set-up from config, the schedules (λ, rollout) and the step."""
