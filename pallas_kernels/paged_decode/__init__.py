"""The ragged paged decode attention kernel."""
