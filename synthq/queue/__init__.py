"""The queue: the ledger of leased work, each kind's transitions, workers, dispatch, sweep."""
