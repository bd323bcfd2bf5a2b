"""Served teachers: opd's teacher server, its client, the binary wire format and the OpenAI-compatible protocol."""
