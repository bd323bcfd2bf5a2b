"""Task environments: answer verification, tools and the environments of multi-turn rollouts."""
