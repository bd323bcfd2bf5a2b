"""Tools: what a tool is, running its calls within limits (threads, worker processes), and the built-in ones."""
