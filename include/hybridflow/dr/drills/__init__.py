"""A drill: a takeover at minimum scale with the primary's storage out of reach, then back, judged and recorded."""
