// goverify reads a log published by `ledger publish` with tools nobody at runledger wrote:
// filippo.io/torchwood (TileFetcher, Client, ParseCheckpoint), golang.org/x/mod/sumdb/note and
// sumdb/tlog (signatures, inclusion and consistency proofs) and, for witnesses,
// github.com/transparency-dev/formats' cosignature verifier.
//
//	goverify -url http://127.0.0.1:PORT/ -vkey VKEY -origin runledger/ID [-old FILE] [-witness VKEY]
//
// It fetches the checkpoint over HTTP, verifies its signature, walks every entry (each bundle
// checked against the signed tree), proves a few entries' inclusion, checks the consistency
// proof from an older checkpoint (-old) and the signed manifest. Exit 0 and one JSON line on
// success; exit 1 and the reason on stderr otherwise.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"filippo.io/torchwood"
	fnote "github.com/transparency-dev/formats/note"
	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

type summary struct {
	Origin    string `json:"origin"`
	Size      int64  `json:"size"`
	Events    int    `json:"events"`
	Commits   int    `json:"commits"`
	Snapshots int    `json:"snapshots"`
	Proved    int    `json:"inclusion_proofs"`
	OldSize   int64  `json:"consistent_from"`
	Cosigned  bool   `json:"cosigned"`
}

func main() {
	url := flag.String("url", "", "base URL of the published log")
	vkey := flag.String("vkey", "", "the log's note verifier key")
	origin := flag.String("origin", "", "the expected origin line")
	old := flag.String("old", "", "an older checkpoint file to check consistency from")
	witness := flag.String("witness", "", "a witness's cosignature/v1 vkey that must have cosigned")
	flag.Parse()
	s, err := run(*url, *vkey, *origin, *old, *witness)
	if err != nil {
		fmt.Fprintln(os.Stderr, "goverify:", err)
		os.Exit(1)
	}
	out, _ := json.Marshal(s)
	fmt.Println(string(out))
}

func openCheckpoint(text []byte, verifiers note.Verifiers, origin string) (torchwood.Checkpoint, error) {
	n, err := note.Open(text, verifiers)
	if err != nil {
		return torchwood.Checkpoint{}, fmt.Errorf("checkpoint signature: %w", err)
	}
	c, err := torchwood.ParseCheckpoint(n.Text)
	if err != nil {
		return c, err
	}
	if c.Origin != origin {
		return c, fmt.Errorf("origin %q, want %q", c.Origin, origin)
	}
	return c, nil
}

func run(url, vkey, origin, oldPath, witness string) (*summary, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	logKey, err := note.NewVerifier(vkey)
	if err != nil {
		return nil, err
	}
	fetcher, err := torchwood.NewTileFetcher(url)
	if err != nil {
		return nil, err
	}
	text, err := fetcher.ReadEndpoint(ctx, "checkpoint")
	if err != nil {
		return nil, err
	}
	s := &summary{}
	if witness != "" {
		w, err := fnote.NewVerifierForCosignatureV1(witness)
		if err != nil {
			return nil, err
		}
		if _, err := note.Open(text, note.VerifierList(w)); err != nil {
			return nil, fmt.Errorf("cosignature: %w", err)
		}
		s.Cosigned = true
	}
	c, err := openCheckpoint(text, note.VerifierList(logKey), origin)
	if err != nil {
		return nil, err
	}
	s.Origin, s.Size = c.Origin, c.N
	client, err := torchwood.NewClient(fetcher)
	if err != nil {
		return nil, err
	}
	var lastManifest string
	next := int64(0)
	for next < c.N { // Entries may stop short of a trailing partial tile: resume until the end
		before := next
		for i, entry := range client.Entries(ctx, c.Tree, next) {
			if i != next {
				return nil, fmt.Errorf("entry %d came where %d was expected", i, next)
			}
			var doc map[string]any
			if err := json.Unmarshal(entry, &doc); err != nil {
				return nil, fmt.Errorf("entry %d is not JSON: %w", i, err)
			}
			switch doc["t"] {
			case "event":
				s.Events++
			case "commit":
				s.Commits++
			case "snapshot":
				s.Snapshots++
				lastManifest, _ = doc["manifest_sha256"].(string)
			default:
				return nil, fmt.Errorf("entry %d has unknown kind %v", i, doc["t"])
			}
			next++
		}
		if err := client.Err(); err != nil {
			return nil, err
		}
		if next == before {
			return nil, errors.New("no progress walking the entries")
		}
	}
	for _, i := range []int64{0, c.N / 2, c.N - 1} {
		if _, _, err := client.Entry(ctx, c.Tree, i); err != nil {
			return nil, err
		}
		s.Proved++
	}
	if oldPath != "" {
		if s.OldSize, err = checkConsistency(ctx, oldPath, logKey, origin, c, fetcher); err != nil {
			return nil, err
		}
	}
	return s, checkManifest(ctx, fetcher, logKey, origin, lastManifest)
}

func checkConsistency(ctx context.Context, path string, key note.Verifier, origin string, c torchwood.Checkpoint, tr torchwood.TileReader) (int64, error) {
	text, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	old, err := openCheckpoint(text, note.VerifierList(key), origin)
	if err != nil {
		return 0, fmt.Errorf("old checkpoint: %w", err)
	}
	proof, err := tlog.ProveTree(c.N, old.N, torchwood.TileHashReaderWithContext(ctx, c.Tree, tr))
	if err != nil {
		return 0, err
	}
	if err := tlog.CheckTree(proof, c.N, c.Hash, old.N, old.Hash); err != nil {
		return 0, fmt.Errorf("consistency %d -> %d: %w", old.N, c.N, err)
	}
	return old.N, nil
}

// checkManifest: manifest.sig is a note by the log key over the manifest's SHA-256, and the last
// snapshot entry in the log names the same digest.
func checkManifest(ctx context.Context, tr torchwood.TileReader, key note.Verifier, origin, logged string) error {
	manifest, err := tr.ReadEndpoint(ctx, "manifest.json")
	if err != nil {
		return err
	}
	sig, err := tr.ReadEndpoint(ctx, "manifest.sig")
	if err != nil {
		return err
	}
	n, err := note.Open(sig, note.VerifierList(key))
	if err != nil {
		return fmt.Errorf("manifest signature: %w", err)
	}
	lines := strings.Split(n.Text, "\n")
	sum := sha256.Sum256(manifest)
	if len(lines) != 4 || lines[0] != origin+"/manifest" || lines[2] != base64.StdEncoding.EncodeToString(sum[:]) {
		return errors.New("manifest.sig does not sign this manifest")
	}
	if _, err := strconv.ParseInt(lines[1], 10, 64); err != nil {
		return errors.New("manifest.sig has no log size")
	}
	if logged != fmt.Sprintf("%x", sum) {
		return errors.New("the log's last snapshot entry names another manifest")
	}
	return nil
}
