// A connector in its own process, driven by one-line commands on stdin, answering one
// line on stdout ("ok [json]" or "error <code> <message>"). The producer side of the
// connector conformance tests and of `ecx bench transfer --connectors`.
//
//   save <mm_hash> <seed> <dtype> <d0,d1,...>   begin + fill pattern(seed) + commit
//   begin <mm_hash> <dtype> <d0,d1,...>         reserve only (the entry is "being written")
//   commit <mm_hash> <seed>                     fill + commit a begun entry
//   read <params-json>                          READ a p2p block as a bare consumer agent,
//                                               without releasing it (then get killed)
//   stats                                       the connector's stats
//   wait-unpinned <ms>                          until the producer pool has no pins
//   quit
#pragma once

#include <string>

namespace ecx::bench {

int run_connector_peer(const std::string& config_json);

}  // namespace ecx::bench
