"""State held in memory across a re-form: snapshots with a copy on a buddy rank, resharding, and a leaving rank's hand-off."""
