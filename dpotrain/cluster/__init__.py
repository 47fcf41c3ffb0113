"""The launch: engine, collectives, build locks, offline and Hub reachability."""
