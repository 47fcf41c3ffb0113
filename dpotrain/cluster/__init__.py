"""The launch: engine, collectives, offline and Hub reachability."""
