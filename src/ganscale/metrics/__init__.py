"""Quality measures for generated samples."""
