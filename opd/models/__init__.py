"""Models: interfaces, loading, tiny local models, the student policy, generation and teachers."""
