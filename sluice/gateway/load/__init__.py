"""Pod load: scraped engine metrics shared through Redis, and the picker's own in-flight counts."""
