"""Task environments: answer extraction and verification."""
