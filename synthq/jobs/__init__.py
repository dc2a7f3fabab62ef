"""A job's data in and out of SQL: samples enqueued, answers retokenized, training data exported."""
