"""Host-side preparation of a step: items in, packed rows and corruption out."""
