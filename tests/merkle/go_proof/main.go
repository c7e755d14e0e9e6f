// goproof checks a C2SP tlog-proof written by `ledger prove inclusion --format tlog-proof` with code
// nobody at runledger wrote: github.com/transparency-dev/formats/proof parses it, x/mod's
// sumdb/note verifies the checkpoint's signature, torchwood parses the checkpoint, and
// sumdb/tlog checks the inclusion of the entry (the proof's extra data) at its index.
//
//	goproof -proof FILE -vkey VKEY -origin runledger/ID
//
// Exit 0 and one JSON line on success; exit 1 and the reason on stderr otherwise.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"filippo.io/torchwood"
	"github.com/transparency-dev/formats/proof"
	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

type summary struct {
	Origin string          `json:"origin"`
	Size   int64           `json:"size"`
	Index  uint64          `json:"index"`
	Entry  json.RawMessage `json:"entry"`
}

func main() {
	path := flag.String("proof", "", "the .tlog-proof file")
	vkey := flag.String("vkey", "", "the log's note verifier key")
	origin := flag.String("origin", "", "the expected origin line")
	flag.Parse()
	s, err := run(*path, *vkey, *origin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "goproof:", err)
		os.Exit(1)
	}
	out, _ := json.Marshal(s)
	fmt.Println(string(out))
}

func run(path, vkey, origin string) (*summary, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var p proof.TLogProof
	if err := p.Unmarshal(data); err != nil {
		return nil, err
	}
	verifier, err := note.NewVerifier(vkey)
	if err != nil {
		return nil, err
	}
	n, err := note.Open(p.Checkpoint, note.VerifierList(verifier))
	if err != nil {
		return nil, fmt.Errorf("checkpoint signature: %w", err)
	}
	c, err := torchwood.ParseCheckpoint(n.Text)
	if err != nil {
		return nil, err
	}
	if c.Origin != origin {
		return nil, fmt.Errorf("origin %q, want %q", c.Origin, origin)
	}
	if p.ExtraData == nil {
		return nil, fmt.Errorf("no extra data: the entry is needed")
	}
	if p.Index >= uint64(c.N) {
		return nil, fmt.Errorf("index %d is not below the tree size %d", p.Index, c.N)
	}
	hashes := make(tlog.RecordProof, len(p.Hashes))
	for i, h := range p.Hashes {
		hashes[i] = tlog.Hash(h)
	}
	if err := tlog.CheckRecord(hashes, c.N, c.Hash, int64(p.Index), tlog.RecordHash(p.ExtraData)); err != nil {
		return nil, fmt.Errorf("inclusion: %w", err)
	}
	if !json.Valid(p.ExtraData) {
		return nil, fmt.Errorf("the entry is not JSON")
	}
	return &summary{Origin: c.Origin, Size: c.N, Index: p.Index, Entry: p.ExtraData}, nil
}
